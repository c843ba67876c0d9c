"""Choosing and loading the checkpoint a run continues from, and the checks that it fits.

`resume_point` turns `--resume` into a run directory and a checkpoint: the newest one that
verifies, corrupt newer ones moved aside loudly. `load_checkpoint` verifies it, restores the
RNG and returns lazy mappings that read one tensor per access, so a resume holds one segment's
tensors in RAM at a time.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tierlm.checkpoint.dcp import DCPTensors
from tierlm.checkpoint.format import (
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    read_manifest,
    read_state,
    verify_checkpoint,
)
from tierlm.checkpoint.publish import recover_checkpoints
from tierlm.checkpoint.safetensors_io import TensorFiles


def latest_valid_checkpoint(
    run_dir: Path, warn: Callable[[str], None] = print, *, quarantine: bool = False
) -> Path:
    """The newest checkpoint that passes verification; older ones are tried loudly.

    With `quarantine`, newer checkpoints that failed are renamed to `corrupt-step_N` (kept for
    inspection, out of the listing) so that later saves and pruning never count them as good.
    """
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(
            f"--resume {run_dir}: no checkpoints under {checkpoint_dir(run_dir)}; "
            "start over there with --overwrite instead of --resume, or point --resume at a run "
            "directory with checkpoints"
        )
    failed = []
    for path in reversed(candidates):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            warn(f"WARNING: {exc}; trying the previous checkpoint")
            failed.append(path)
            continue
        if quarantine:
            for bad in failed:
                aside = bad.parent / f"corrupt-{bad.name}-{int(time.time())}"
                os.replace(bad, aside)
                warn(f"WARNING: moved the corrupt checkpoint {bad.name} aside to {aside}")
        if failed:
            warn(f"WARNING: using the older checkpoint {path}")
        return path
    raise CheckpointError(
        f"--resume {run_dir}: every checkpoint failed verification "
        f"({', '.join(p.name for p in candidates)}); nothing was loaded. Move them away to start "
        "over, or restore a good copy"
    )


def last_good_checkpoint(run_dir: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint that verifies, or None when the run has none at all."""
    return latest_valid_checkpoint(run_dir, warn) if list_checkpoints(run_dir) else None


def resume_point(
    resume: str | None, out: str | None, log: Callable[[str], None] = print
) -> tuple[Path | None, Path | None]:
    """(run directory, checkpoint to continue from) for `--resume`; (None, None) without it.

    `--resume auto` continues the newest valid checkpoint under `--out`, or starts fresh there
    when it has none, so one command line can simply be rerun after a crash. Leftovers of a
    crash are cleaned up first; corrupt checkpoints newer than the chosen one are moved aside,
    loudly. If checkpoints exist but none verifies, that is an error, never a silent restart.
    """
    if not resume:
        return None, None
    run_dir = Path(out if resume == "auto" else resume)  # type: ignore[arg-type]
    recover_checkpoints(run_dir, log)
    if resume == "auto" and not list_checkpoints(run_dir):
        log(f"--resume auto: no checkpoint under {run_dir}; starting a fresh run there")
        return run_dir, None
    return run_dir, latest_valid_checkpoint(run_dir, warn=log, quarantine=True)


def load_checkpoint(
    path: Path,
) -> tuple[TensorFiles | DCPTensors, TensorFiles | DCPTensors, dict[str, Any]]:
    """Verify a checkpoint, restore the RNG, and return (weights, optimizer state, state.json).

    Weights and optimizer state are lazy mappings: each tensor is read when accessed
    (`DCPTensors` for an FSDP run's checkpoint, which its stepper loads through dcp instead).
    """
    manifest = read_manifest(path)
    verify_checkpoint(path)
    state = read_state(path)

    def files(kind: str) -> list[Path]:
        pattern = re.compile(rf"{kind}(-.+)?\.safetensors")
        return [path / n for n in sorted(manifest) if pattern.fullmatch(n)]

    weights: TensorFiles | DCPTensors
    optim: TensorFiles | DCPTensors
    if state.get("tensors") == "dcp":
        world_size = int(state.get("world_size", 0))
        weights = DCPTensors(path, "model.", world_size)
        optim = DCPTensors(path, "optim.", world_size)
    else:
        weights, optim = TensorFiles(files("model")), TensorFiles(files("optimizer"))
        check_tensor_names(path, state, {**weights.names_by_file(), **optim.names_by_file()})
    rng = TensorFiles([path / "rng.safetensors"])
    try:
        torch.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
            if len(cuda_states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_states)
    except (KeyError, RuntimeError, TypeError) as exc:  # torch refuses a malformed state
        raise CheckpointError(f"checkpoint {path}: rng.safetensors holds no valid RNG state "
                              f"({exc})") from None
    return weights, optim, state


def check_tensor_names(path: Path, state: Mapping[str, Any], held: dict[str, list[str]]) -> None:
    """Each state file holds the tensors state.json lists for it (checkpoints written before
    the list existed are not checked): a file whose header was rewritten, even with checksums
    to match, is refused instead of resuming with renamed or missing tensors. `held`: each
    file's tensor names as its header has them."""
    listed = state.get("tensor_names")
    if listed is None:
        return
    if not isinstance(listed, dict):
        raise CheckpointError(f"checkpoint {path}: state.json's tensor_names is not a mapping")
    for name, expected in listed.items():
        if (path / name).is_file() and held.get(name, []) != expected:
            raise CheckpointError(
                f"checkpoint {path}: {name} does not hold the tensors state.json lists for it "
                "(one of the two is damaged); resume from another checkpoint"
            )


def check_tensor_format(path: Path, state: Mapping[str, Any], fsdp_world_size: int | None) -> None:
    """Refuse to resume a checkpoint of the other kind: an FSDP run (`fsdp_world_size`, its
    number of ranks) resumes only dcp checkpoints of its own world size, other runs only
    name-keyed safetensors."""
    written = int(state.get("world_size", 0)) if state.get("tensors") == "dcp" else None
    if written is not None and fsdp_world_size is None:
        raise CheckpointError(
            f"checkpoint {path} was written by an FSDP run (torch.distributed.checkpoint shards "
            f"of {written} processes): resume it with --backend fsdp --nproc {written}, or "
            "`tierlm export` it and start from the export with --model"
        )
    if written is None and fsdp_world_size is not None:
        raise CheckpointError(
            f"checkpoint {path} holds name-keyed safetensors from a run without --backend fsdp, "
            "and --backend fsdp resumes only its own torch.distributed.checkpoint shards: resume "
            "it with the backend that wrote it, or `tierlm export` it and start from the export "
            "with --model"
        )
    if written is not None and written != fsdp_world_size:
        raise CheckpointError(
            f"checkpoint {path} holds FSDP shards of {written} processes, this run has "
            f"{fsdp_world_size}: resume with --nproc {written}"
        )


def check_weight_names(
    expected: set[str] | Mapping[str, tuple[int, ...]],
    weights: Mapping[str, torch.Tensor],
    path: Path,
) -> None:
    """Refuse a checkpoint whose tensors are not this model's parameters: by name, and by
    shape when `expected` maps names to shapes (a model of another size has the same names)."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = []
    if isinstance(expected, Mapping) and not missing:
        for name, shape in expected.items():
            got = weights.shape(name) if isinstance(weights, TensorFiles | DCPTensors) else (
                tuple(weights[name].shape))
            if tuple(got) != tuple(shape):
                wrong.append(f"{name} {tuple(got)} vs {tuple(shape)}")
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit this model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, shapes {wrong[:3]}); resume with the same "
            "--model/--model-size"
        )

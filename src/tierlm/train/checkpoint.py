"""Checkpoints: safetensors for tensors, JSON for the rest, a checksum manifest, atomic writes.

Layout of one checkpoint (a directory under RUN_DIR/checkpoints/):

    step_00000010/
        model.safetensors       weights (tied tensors stored once)
        optimizer.safetensors   optimizer state tensors, keyed "<param index>.<name>"
        rng.safetensors         torch RNG states
        config.json             the Hugging Face model config (so the directory exports alone)
        tokenizer.json, ...     the run's tokenizer
        state.json              step, data position, optimizer hyper-parameters, run config
        manifest.json           sha256 and size of every other file

A checkpoint is written into a temporary sibling, fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never a torn directory. Nothing is ever
unpickled on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model; the message says which."""


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int
    sampler: dict[str, int]
    run_config: dict[str, Any]
    skipped_steps: int = 0


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path,
    *,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor],
    model_config: Any,
    tokenizer: Any,
    state: TrainState,
) -> Path:
    """Write a complete checkpoint for `state.step` atomically and return its directory.

    `weights` and `optimizer_state` are keyed by the model's parameter names (tied tensors
    once), as both runtimes produce them, so either runtime can resume the other's checkpoint.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    save_file(
        {k: v.contiguous() for k, v in optimizer_state.items()},
        str(tmp / "optimizer.safetensors"),
    )
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    save_file(rng, str(tmp / "rng.safetensors"))
    model_config.to_json_file(str(tmp / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    state_json = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "sampler": state.sampler,
        "skipped_steps": state.skipped_steps,
        "run_config": state.run_config,
    }
    (tmp / "state.json").write_text(json.dumps(state_json, indent=1), encoding="utf-8")

    manifest = {}
    for f in sorted(tmp.iterdir()):
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
        manifest[f.name] = {"sha256": _sha256(f), "size_bytes": f.stat().st_size}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    with (tmp / MANIFEST).open("rb") as fh:
        os.fsync(fh.fileno())
    _fsync_dir(tmp)

    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    return final


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file whose size or sha256 differs."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (incomplete write?)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: {exc}") from None
    for name, entry in manifest.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != entry["size_bytes"] or _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary directories excluded)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_valid_checkpoint(run_dir: Path, warn=print) -> Path:
    """The newest checkpoint that passes verification; older ones are tried loudly."""
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(
            f"--resume {run_dir}: no checkpoints under {checkpoint_dir(run_dir)}; "
            "start without --resume or point it at a run directory with checkpoints"
        )
    for path in reversed(candidates):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as exc:
            warn(f"WARNING: {exc}; trying the previous checkpoint")
    raise CheckpointError(f"--resume {run_dir}: every checkpoint failed verification")


def read_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format version {state.get('format_version')}, "
            f"this tierlm reads {FORMAT_VERSION}"
        )
    return state


def load_checkpoint(
    path: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Verify a checkpoint, restore the RNG, and return (weights, optimizer state, state.json)."""
    verify_checkpoint(path)
    state = read_state(path)
    weights = load_file(str(path / "model.safetensors"))
    optim = load_file(str(path / "optimizer.safetensors"))
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    return weights, optim, state


def check_weight_names(expected: set[str], weights: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint whose tensors are not this model's parameters."""
    missing = sorted(expected - set(weights))
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit this model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); resume with the same --model/--model-size"
        )

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
from safetensors.torch import load_file, load_model, save_file, save_model

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


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            key = f"{idx}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(opt: torch.optim.Optimizer, path: Path, meta: dict) -> None:
    tensors = load_file(str(path))
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    run_dir: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    state: TrainState,
) -> Path:
    """Write a complete checkpoint for `state.step` atomically and return its directory."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    save_model(model, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    save_file(rng, str(tmp / "rng.safetensors"))
    model.config.to_json_file(str(tmp / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    state_json = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "sampler": state.sampler,
        "skipped_steps": state.skipped_steps,
        "optimizer": opt_meta,
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
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Load weights (and optimizer state, RNG) from a verified checkpoint; return state.json."""
    verify_checkpoint(path)
    state = read_state(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit this model "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}); "
            "resume with the same --model/--model-size"
        )
    if optimizer is not None:
        _load_optimizer(optimizer, path / "optimizer.safetensors", state["optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    return state

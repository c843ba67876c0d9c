"""Checkpoint format: the layout, its errors, the manifest and the listing of a run's checkpoints.

Layout of one checkpoint (a directory under RUN_DIR/checkpoints/):

    step_00000010/
        model[-<shard>].safetensors      weights by parameter name (tied tensors stored once)
        optimizer[-<shard>].safetensors  optimizer state, keyed "<parameter name>.<state name>"
        rng.safetensors                  torch RNG states
        config.json                      the Hugging Face model config (so the directory exports
                                         alone), and generation_config.json when the model has one
        tokenizer.json, ...              the run's tokenizer
        state.json                       step, data position, skipped steps, run config, fp8
                                         scaling state, each model/optimizer file's tensor
                                         names (checked on load)
        manifest.json                    sha256 and size of every other file

An FSDP run keeps its tensors in torch.distributed.checkpoint files instead (checkpoint/dcp.py).
Everything besides tensors is JSON; tensors are safetensors (checkpoint/safetensors_io.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
DCP_FORMAT_VERSION = 3  # tensors in torch.distributed.checkpoint files (FSDP runs)
READABLE_VERSIONS = (1, 2, 3)  # 1: one model.safetensors and one optimizer.safetensors
MANIFEST = "manifest.json"
STEP_PREFIX = "step_"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model; the message says which."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the previous ones are untouched."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_  # the OSError's, so callers can tell a full disk from an I/O error


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int
    sampler: dict[str, int]
    run_config: dict[str, Any]
    skipped_steps: int = 0
    fp8: list[dict[str, Any]] | None = None
    """Per rank: fp8 layers switched to bf16, overflow streaks, delayed-scaling histories."""
    source_dtype: str | None = None
    """The dtype of the weights the run started from (a Hugging Face checkpoint's config dtype;
    float32 for a preset): what `--export-dtype auto` exports in."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_bytes(path: Path) -> int:
    """Total size of a checkpoint according to its manifest (0 if unreadable)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return sum(int(e["size_bytes"]) for e in manifest.values()) + (path / MANIFEST).stat(
        ).st_size
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (incomplete write?)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: {exc}") from None
    ok = isinstance(manifest, dict) and all(
        isinstance(e, dict) and isinstance(e.get("sha256"), str)
        and isinstance(e.get("size_bytes"), int) for e in manifest.values()
    )
    if not ok:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt (bad entries)")
    for name in manifest:  # plain file names only: a manifest must not point outside
        if Path(name).name != name or name in (".", "..", MANIFEST):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} names {name!r}")
    return manifest


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file whose size or sha256 differs."""
    for name, entry in read_manifest(path).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != entry["size_bytes"] or sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary directories excluded)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable: {exc}") from None
    if not isinstance(state, dict) or state.get("format_version") not in READABLE_VERSIONS:
        version = state.get("format_version") if isinstance(state, dict) else None
        raise CheckpointError(
            f"checkpoint {path}: state.json has format version {version}, this tierlm reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return state


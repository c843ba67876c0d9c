"""Writing a checkpoint and publishing it atomically; pruning; recovery after a crash.

Tensors arrive in shards (`stepper.state_shards()`: one per segment for the tiered runtime, one
for the reference trainer) and each shard is written and released before the next is read, so
saving never needs the whole model in RAM: a 7B run whose state lives on disk checkpoints with
a few segments' worth of host memory. Checksums are computed from the bytes as they are written.

A checkpoint is written into a temporary sibling, fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never a torn directory; leftovers of an
interrupted write are cleaned up by `recover_checkpoints`. Only the last `keep` checkpoints are
kept. The layout is in checkpoint/format.py; FSDP runs publish through checkpoint/dcp.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from tierlm.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    STEP_PREFIX,
    CheckpointError,
    CheckpointWriteError,
    TrainState,
    checkpoint_bytes,
    checkpoint_dir,
    list_checkpoints,
    sha256_file,
)
from tierlm.checkpoint.safetensors_io import write_safetensors
from tierlm.crashpoints import crash_point
from tierlm.models.export import fsync_dir
from tierlm.progress import NO_PHASE, Phase
from tierlm.runtime.stepper import Shard

_LEFTOVER = re.compile(r"\.(step_\d+)\.(tmp|old|del)-\d+")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _shard_file(kind: str, shard: str) -> str:
    return f"{kind}-{shard}.safetensors" if shard else f"{kind}.safetensors"


def write_contents(
    tmp: Path, shards: Iterable[Shard], model_config: Any, tokenizer: Any, state: TrainState,
    manifest: dict[str, dict[str, Any]], tensor_format: dict[str, Any] | None = None,
    generation_config: Any = None, progress: Phase = NO_PHASE,
) -> None:
    names: dict[str, list[str]] = {}  # each safetensors file's tensor names, for state.json

    def record(name: str, sha_size: tuple[str, int]) -> None:
        manifest[name] = {"sha256": sha_size[0], "size_bytes": sha_size[1]}
        progress.advance(sha_size[1])
        crash_point("checkpoint-file")

    for shard, weights, optim in shards:  # one shard in memory at a time
        for kind, tensors in (("model", weights), ("optimizer", optim)):
            name = _shard_file(kind, shard)
            if name in manifest:
                raise CheckpointError(f"two state shards are both named {shard!r}")
            record(name, write_safetensors(tmp / name, tensors))
            names[name] = sorted(tensors)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    record("rng.safetensors", write_safetensors(tmp / "rng.safetensors", rng))
    model_config.to_json_file(str(tmp / "config.json"))
    if generation_config is not None:  # generation_config.json, carried into the export
        generation_config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    state_json = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "sampler": state.sampler,
        "skipped_steps": state.skipped_steps,
        "run_config": state.run_config,
        **({"fp8": state.fp8} if state.fp8 else {}),
        **({"source_dtype": state.source_dtype} if state.source_dtype else {}),
        **(tensor_format or {}),
        **({"tensor_names": names} if names else {}),
    }
    (tmp / "state.json").write_text(json.dumps(state_json, indent=1), encoding="utf-8")
    for f in sorted(tmp.iterdir()):  # the small files written by other libraries
        if f.name not in manifest:
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
            manifest[f.name] = {"sha256": sha256_file(f), "size_bytes": f.stat().st_size}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    with (tmp / MANIFEST).open("rb") as fh:
        os.fsync(fh.fileno())
    fsync_dir(tmp)



def write_failed_error(
    exc: OSError, final: Path, run_dir: Path, written_bytes: int
) -> CheckpointWriteError:
    previous = list_checkpoints(run_dir)
    kept = f"the previous checkpoint {previous[-1]} is untouched" if previous else (
        "no earlier checkpoint exists")
    if exc.errno in _NO_SPACE:
        try:
            free = f"{shutil.disk_usage(checkpoint_dir(run_dir)).free / 2**20:.1f} MiB are"
        except OSError:
            free = "an unknown amount is"
        size = checkpoint_bytes(previous[-1]) if previous else 0
        need = f"; a checkpoint of this run takes about {size / 2**20:.1f} MiB" if size else ""
        return CheckpointWriteError(
            f"disk full while writing checkpoint {final}: the disk filled after "
            f"{written_bytes / 2**20:.1f} MiB of it{need}, {free} free on that filesystem; "
            f"{kept}. Free space there, lower --keep-checkpoints or point --out at a disk "
            "with room", exc.errno,
        )
    return CheckpointWriteError(
        f"I/O error while writing checkpoint {final}: {exc}; {kept}", exc.errno
    )


def save_checkpoint(
    run_dir: Path,
    *,
    shards: Iterable[Shard] | None = None,
    model_config: Any,
    tokenizer: Any,
    state: TrainState,
    keep: int = 0,
    weights: Mapping[str, torch.Tensor] | None = None,
    optimizer_state: Mapping[str, torch.Tensor] | None = None,
    generation_config: Any = None,
    progress: Phase = NO_PHASE,
) -> Path:
    """Write a complete checkpoint for `state.step` atomically and return its directory.

    `shards` yields (name, weights, optimizer state) keyed by the model's parameter names (tied
    tensors once), as both runtimes produce them, so either runtime can resume the other's
    checkpoint. `keep` > 0 deletes all but the newest `keep` checkpoints afterwards. A write
    that fails (disk full, I/O error) removes its temporary directory and raises
    CheckpointWriteError; the checkpoints already there are never touched by a failed write.
    Whole-state `weights` and `optimizer_state` dicts are accepted too, as one shard.
    `progress` is advanced by the bytes of each file written.
    """
    if shards is None:
        shards = [("", weights or {}, optimizer_state or {})]
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{STEP_PREFIX}{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    written: dict[str, dict[str, Any]] = {}
    try:
        tmp.mkdir()
        write_contents(tmp, shards, model_config, tokenizer, state, written,
                        generation_config=generation_config, progress=progress)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            done = sum(e["size_bytes"] for e in written.values())
            raise write_failed_error(exc, final, run_dir, done) from exc
        raise

    publish(tmp, final, run_dir, keep)
    return final


def publish(tmp: Path, final: Path, run_dir: Path, keep: int) -> None:
    """Rename a complete temporary checkpoint into place, then prune to the newest `keep`."""
    root = final.parent
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)  # a crash between the renames: recover_checkpoints puts it back
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    if keep > 0:
        prune_checkpoints(run_dir, keep)

def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns the deleted ones. Each is renamed
    out of the listing first, so a crash mid-delete never leaves a half checkpoint listed."""
    removed = []
    for path in list_checkpoints(run_dir)[:-keep]:
        doomed = path.parent / f".{path.name}.del-{os.getpid()}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def recover_checkpoints(run_dir: Path, log: Callable[[str], None] = print) -> None:
    """Clean up after a crash: delete half-written and half-deleted checkpoints, and put back
    a checkpoint that was moved aside to be replaced when the crash hit between the renames."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        m = _LEFTOVER.fullmatch(path.name)
        if not m or not path.is_dir():
            continue
        final = root / m.group(1)
        if m.group(2) == "old" and not final.exists():
            os.replace(path, final)
            log(f"restored checkpoint {final} (a crash interrupted its replacement)")
        else:
            shutil.rmtree(path, ignore_errors=True)
            if m.group(2) == "tmp":
                log(f"removed {path.name}: a checkpoint write interrupted by a crash")



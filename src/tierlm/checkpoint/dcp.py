"""Checkpoints of FSDP runs, kept in torch.distributed.checkpoint (dcp) form.

An FSDP run (`--backend fsdp`) holds no rank's worth of full state, so its checkpoints keep the
tensors in dcp form instead of the two safetensors kinds:

        __<rank>_<i>.distcp              each rank's own shards of weights ("model.<name>") and
                                         AdamW state ("optim.<name>.<state>"), written by that rank
        .metadata                        dcp's index of those shards (written by rank 0)

with the same rng, config, tokenizer, state.json (format 3, `"tensors": "dcp"`, the world size)
and manifest, all of which rank 0 writes (`save_sharded_checkpoint`). Such a checkpoint resumes
an FSDP run of the same world size only; `DCPTensors` reads it without a process group, tensor
by tensor, for export. The one pickle is dcp's `.metadata` index, unpickled by torch only after
the manifest verified it (dcp reads its tensors with `torch.load(weights_only=True)`, and we
store no non-tensor values in dcp, which it would unpickle freely).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from tierlm.checkpoint.format import (
    DCP_FORMAT_VERSION,
    STEP_PREFIX,
    CheckpointError,
    CheckpointWriteError,
    TrainState,
    checkpoint_dir,
    sha256_file,
)
from tierlm.checkpoint.publish import publish, write_contents, write_failed_error


class ShardedState(Protocol):
    """State of which every rank writes its own part (FSDP, via torch.distributed.checkpoint)."""

    def save_sharded(self, path: Path) -> None:
        """Collective: write this rank's shards into the directory `path`."""


class Ranks(Protocol):
    """What a sharded save needs of `tierlm.distributed.world.World`."""

    rank: int
    size: int

    @property
    def is_main(self) -> bool: ...

    def from_main(self, obj: Any) -> Any: ...

    def gather_to_main(self, obj: Any) -> list[Any] | None: ...


class DCPTensors(Mapping[str, torch.Tensor]):
    """The full tensors under one key prefix ("model." or "optim.") of a checkpoint kept in
    torch.distributed.checkpoint files, each assembled from every rank's shard when accessed.

    Reading needs no process group (dcp's `no_dist` path), so rank 0 alone, or `tierlm export`,
    can read an FSDP run's checkpoint; an FSDP run resumes from `path` through dcp instead,
    each rank reading only its own shards.
    """

    def __init__(self, path: Path, prefix: str, world_size: int) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.prefix = prefix
        self.world_size = world_size  # of the run that wrote it
        try:
            meta = FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - any failure to unpickle the index
            raise CheckpointError(
                f"checkpoint {path}: dcp .metadata is unreadable ({exc})") from None
        self._meta = {
            key[len(prefix):]: m for key, m in meta.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name].properties.dtype

    def nbytes(self, name: str) -> int:
        m = self._meta[name]
        return m.size.numel() * torch.empty((), dtype=m.properties.dtype).element_size()

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Several full tensors in one pass over the shard files."""
        import torch.distributed.checkpoint as dcp

        out = {n: torch.empty(self._meta[n].size, dtype=self._meta[n].properties.dtype)
               for n in names}
        try:
            with warnings.catch_warnings():  # "assuming ... a single process": as intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({self.prefix + n: t for n, t in out.items()},
                         checkpoint_id=str(self.path), no_dist=True)
        except BaseException as exc:  # dcp wraps I/O errors in CheckpointException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            raise CheckpointError(f"checkpoint {self.path}: cannot read {sorted(out)[:3]} from "
                                  f"its dcp shards ({type(exc).__name__})") from exc
        return out


def _own_dcp_files(tmp: Path, rank: int) -> dict[str, dict[str, Any]] | str:
    """Manifest entries of the shard files rank `rank` wrote (an error text if it cannot read
    them: every rank must reach the gather, or the others would wait for it forever)."""
    try:
        return {
            f.name: {"sha256": sha256_file(f), "size_bytes": f.stat().st_size}
            for f in sorted(tmp.glob(f"__{rank}_*.distcp"))
        }
    except OSError as exc:
        return f"rank {rank} could not read back its shards: {exc}"


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write, also when dcp wrapped it (per rank) in its
    CheckpointException."""
    if isinstance(exc, OSError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return None


def save_sharded_checkpoint(
    run_dir: Path,
    sharded: ShardedState,
    world: Ranks,
    *,
    model_config: Any,
    tokenizer: Any,
    state: TrainState,
    keep: int = 0,
    generation_config: Any = None,
) -> Path:
    """Collective: the checkpoint of an FSDP run, each rank writing only its own shards.

    Rank 0 names the temporary directory; every rank writes its shards into it with
    torch.distributed.checkpoint and checksums the files it wrote; rank 0 gathers those
    checksums (so every rank has finished before anything is published), adds the RNG, config,
    tokenizer, state.json and manifest, and renames the directory into place as
    `save_checkpoint` does. Returns the checkpoint on every rank; a failure on any rank raises
    on every rank, and the temporary directory is removed.
    """
    root = checkpoint_dir(run_dir)
    final = root / f"{STEP_PREFIX}{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = world.from_main(tmp)  # rank 0's name: every rank writes into the same directory
    try:
        sharded.save_sharded(tmp)
    except BaseException as exc:  # dcp raises on every rank when one rank's write failed
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        os_error = _os_error(exc)
        if os_error is not None:
            raise write_failed_error(os_error, final, run_dir, 0) from exc
        raise
    parts = world.gather_to_main(_own_dcp_files(tmp, world.rank))  # the barrier before publishing
    outcome: Path | str = final
    error: CheckpointError | None = None
    if world.is_main:
        written: dict[str, dict[str, Any]] = {}
        try:
            for part in parts or []:
                if isinstance(part, str):
                    raise CheckpointError(part)
                written.update(part)
            write_contents(tmp, [], model_config, tokenizer, state, written, {
                "format_version": DCP_FORMAT_VERSION, "tensors": "dcp",
                "world_size": world.size,
            }, generation_config=generation_config)
            publish(tmp, final, run_dir, keep)
        except (OSError, CheckpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = write_failed_error(exc, final, run_dir, 0) if isinstance(exc, OSError) else exc
            outcome = str(error)
    outcome = world.from_main(outcome)  # the others return only once it is published
    if error is not None:
        raise error
    if isinstance(outcome, str):
        raise CheckpointWriteError(outcome)
    return outcome


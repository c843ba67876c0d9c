"""Checkpoints: safetensors for tensors, JSON for the rest, a checksum manifest, atomic writes.

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

Tensors arrive in shards (`stepper.state_shards()`: one per segment for the tiered runtime, one
for the reference trainer) and each shard is written and released before the next is read, so
saving never needs the whole model in RAM: a 7B run whose state lives on disk checkpoints with
a few segments' worth of host memory. The reader likewise returns lazy mappings that read one
tensor per access. Checksums are computed from the bytes as they are written.

An FSDP run (`--backend fsdp`) holds no rank's worth of full state, so its checkpoints keep the
tensors in `torch.distributed.checkpoint` (dcp) form instead of the two safetensors kinds:

        __<rank>_<i>.distcp              each rank's own shards of weights ("model.<name>") and
                                         AdamW state ("optim.<name>.<state>"), written by that rank
        .metadata                        dcp's index of those shards (written by rank 0)

with the same rng, config, tokenizer, state.json (format 3, `"tensors": "dcp"`, the world size)
and manifest, all of which rank 0 writes (`save_sharded_checkpoint`). Such a checkpoint resumes
an FSDP run of the same world size only; `DCPTensors` reads it without a process group, tensor
by tensor, for export.

A checkpoint is written into a temporary sibling, fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never a torn directory; leftovers of an
interrupted write are cleaned up by `recover_checkpoints`. Only the last `keep` checkpoints are
kept. Tensors are read from safetensors files by our own strict reader, everything else is
JSON; the one pickle is dcp's `.metadata` index, unpickled by torch only after the manifest
verified it (dcp reads its tensors with `torch.load(weights_only=True)`, and we store no
non-tensor values in dcp, which it would unpickle freely).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tierlm.crashpoints import crash_point
from tierlm.models.export import (
    DEFAULT_MAX_SHARD_BYTES,
    SourceTensor,
    export_dtype,
    fsync_dir,
    natural_key,
    source_dtype,
    write_hf_model,
)
from tierlm.monitor.progress import NO_PHASE, NO_PROGRESS, Phase, Progress
from tierlm.runtime.state import opened
from tierlm.runtime.stepper import Shard

FORMAT_VERSION = 2
DCP_FORMAT_VERSION = 3  # tensors in torch.distributed.checkpoint files (FSDP runs)
READABLE_VERSIONS = (1, 2, 3)  # 1: one model.safetensors and one optimizer.safetensors
MANIFEST = "manifest.json"
_PREFIX = "step_"
_STEP_DIR = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"\.(step_\d+)\.(tmp|old|del)-\d+")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# One state shard: (name, weights by parameter name, optimizer state by "<name>.<state>").


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


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


# -- safetensors, written and read without copies or pickles ----

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_MAX_HEADER_BYTES = 100 << 20  # the safetensors limit; a larger length field means a bad file


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (on the CPU; a device tensor is copied over first) without a copy."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """Write `tensors` as a safetensors file, fsync it, and return (sha256, size in bytes).

    The bytes go straight from the tensors' memory to the file, hashed on the way, so a segment
    of state costs no extra RAM and the checksum needs no second read. A `DiskTensor` (the
    tiered runtime's disk-tier state) is read when its bytes are written, one at a time.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"{path.name}: cannot store {name} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            digest.update(chunk)
        for t in tensors.values():
            with opened(t) as values:  # a disk-tier tensor is read just for its write
                data = _raw_bytes(values)
                f.write(data)
                digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), 8 + len(blob) + offset


class SafetensorsFile:
    """Header of one safetensors file, checked before any tensor is trusted; tensors are read
    with plain file reads (no mmap, so reading a checkpoint does not inflate RSS)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(_MAX_HEADER_BYTES, size - 8):
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is not a mapping")
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype = _DTYPES[e["dtype"]]
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: bad header entry for {name!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            itemsize = torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - self.data_start \
                    or end - begin != numel * itemsize:
                raise CheckpointError(f"{path}: header entry for {name!r} does not fit the file")
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with self.path.open("rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(buf) != end - begin:
                raise CheckpointError(f"{self.path}: truncated tensor {name!r}")
        return out


class TensorFiles(Mapping[str, torch.Tensor]):
    """Tensors of several safetensors files by name, each read from disk when accessed (and not
    kept), so loading a checkpoint segment by segment holds one segment in RAM."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._where: dict[str, SafetensorsFile] = {}
        for path in files:
            f = SafetensorsFile(path)
            for name in f.entries:
                if name in self._where:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in another file")
                self._where[name] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)

    def names_by_file(self) -> dict[str, list[str]]:
        """Each file's tensor names (sorted), by file name, from the headers already read."""
        out: dict[str, list[str]] = {}
        for name, f in self._where.items():
            out.setdefault(f.path.name, []).append(name)
        return {k: sorted(v) for k, v in out.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file's header, without reading it."""
        return self._where[name].entries[name][1]

    def file_of(self, name: str) -> SafetensorsFile:
        """The file that holds `name` (its header says where, for reads in parts)."""
        return self._where[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# -- writing ----

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def _shard_file(kind: str, shard: str) -> str:
    return f"{kind}-{shard}.safetensors" if shard else f"{kind}.safetensors"


def _write_contents(
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
            manifest[f.name] = {"sha256": _sha256(f), "size_bytes": f.stat().st_size}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    with (tmp / MANIFEST).open("rb") as fh:
        os.fsync(fh.fileno())
    fsync_dir(tmp)


def checkpoint_bytes(path: Path) -> int:
    """Total size of a checkpoint according to its manifest (0 if unreadable)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return sum(int(e["size_bytes"]) for e in manifest.values()) + (path / MANIFEST).stat(
        ).st_size
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0


def _write_failed(
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
    final = root / f"{_PREFIX}{state.step:08d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    written: dict[str, dict[str, Any]] = {}
    try:
        tmp.mkdir()
        _write_contents(tmp, shards, model_config, tokenizer, state, written,
                        generation_config=generation_config, progress=progress)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            done = sum(e["size_bytes"] for e in written.values())
            raise _write_failed(exc, final, run_dir, done) from exc
        raise

    _publish(tmp, final, run_dir, keep)
    return final


def _publish(tmp: Path, final: Path, run_dir: Path, keep: int) -> None:
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


def _own_dcp_files(tmp: Path, rank: int) -> dict[str, dict[str, Any]] | str:
    """Manifest entries of the shard files rank `rank` wrote (an error text if it cannot read
    them: every rank must reach the gather, or the others would wait for it forever)."""
    try:
        return {
            f.name: {"sha256": _sha256(f), "size_bytes": f.stat().st_size}
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
    final = root / f"{_PREFIX}{state.step:08d}"
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
            raise _write_failed(os_error, final, run_dir, 0) from exc
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
            _write_contents(tmp, [], model_config, tokenizer, state, written, {
                "format_version": DCP_FORMAT_VERSION, "tensors": "dcp",
                "world_size": world.size,
            }, generation_config=generation_config)
            _publish(tmp, final, run_dir, keep)
        except (OSError, CheckpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = _write_failed(exc, final, run_dir, 0) if isinstance(exc, OSError) else exc
            outcome = str(error)
    outcome = world.from_main(outcome)  # the others return only once it is published
    if error is not None:
        raise error
    if isinstance(outcome, str):
        raise CheckpointWriteError(outcome)
    return outcome


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


# -- reading ----

def _manifest(path: Path) -> dict[str, dict[str, Any]]:
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
    for name, entry in _manifest(path).items():
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
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


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


def load_checkpoint(
    path: Path,
) -> tuple[TensorFiles | DCPTensors, TensorFiles | DCPTensors, dict[str, Any]]:
    """Verify a checkpoint, restore the RNG, and return (weights, optimizer state, state.json).

    Weights and optimizer state are lazy mappings: each tensor is read when accessed
    (`DCPTensors` for an FSDP run's checkpoint, which its stepper loads through dcp instead).
    """
    manifest = _manifest(path)
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
        _check_tensor_names(path, state, {**weights.names_by_file(), **optim.names_by_file()})
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


def _check_tensor_names(path: Path, state: Mapping[str, Any], held: dict[str, list[str]]) -> None:
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


_NOT_EXPORTED = re.compile(
    r"(optimizer(-.+)?|rng)\.safetensors|state\.json|__\d+_\d+\.distcp|\.metadata|config\.json|"
    + re.escape(MANIFEST)
)
_EXPORT_GROUP_BYTES = 1 << 30  # tensors read from dcp shards at a time while exporting
_MODEL_SHARD = re.compile(r"model(-.+)?\.safetensors")


def _read_in_chunks(f: SafetensorsFile, name: str, chunk: int) -> Iterator[torch.Tensor]:
    """Tensor `name` of file `f`, flat, `chunk` elements at a time, each read into the same
    buffer (a piece is valid until the next is asked for)."""
    dtype, _, begin, end = f.entries[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(min(chunk, (end - begin) // itemsize), dtype=dtype)
    with f.path.open("rb") as fh:
        fh.seek(f.data_start + begin)
        for pos in range(begin, end, chunk * itemsize):
            piece = buf[: min(chunk, (end - pos) // itemsize)]
            if fh.readinto(memoryview(piece.view(torch.uint8).numpy())) != piece.nbytes:
                raise CheckpointError(f"{f.path}: truncated tensor {name!r}")
            yield piece


def _file_sources(weights: TensorFiles) -> list[SourceTensor]:
    """Each tensor of a checkpoint's model files, read chunk by chunk straight from its file."""
    out = []
    for name in weights:
        f = weights.file_of(name)
        dtype, shape, _, _ = f.entries[name]
        out.append(SourceTensor(name, shape, dtype, functools.partial(_read_in_chunks, f, name)))
    return out


def _dcp_sources(weights: DCPTensors, order: list[str]) -> list[SourceTensor]:
    """Each full tensor of an FSDP checkpoint, assembled from every rank's shard. dcp reads
    whole tensors, so they are read in groups of about a GiB, in `order` (the export's), and
    each is dropped once written."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in order:
        if groups[-1] and size + weights.nbytes(name) > _EXPORT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += weights.nbytes(name)
    group_of = {name: group for group in groups for name in group}
    loaded: dict[str, torch.Tensor] = {}

    def read(chunk: int, name: str) -> Iterator[torch.Tensor]:
        if name not in loaded:
            loaded.clear()
            loaded.update(weights.read(group_of[name]))
        yield loaded.pop(name).reshape(-1)

    return [SourceTensor(name, weights.shape(name), weights.dtype(name),
                         lambda chunk, name=name: read(chunk, name)) for name in order]


def _parameter_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters (tied ones once) of the model config.json describes,
    from a build on the meta device (no memory)."""
    from transformers import AutoConfig

    from tierlm.models import build_model

    model = build_model(AutoConfig.from_pretrained(str(path), local_files_only=True),
                        device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def checkpoint_export_dtype(path: Path, dtype: str = "auto") -> torch.dtype:
    """The dtype `export_hf_from_checkpoint` writes: `dtype` (`--export-dtype`), where `auto`
    is the dtype of the weights the run started from (state.json's `source_dtype`; from a
    checkpoint written before it was recorded, the run's --model if still there)."""
    state = read_state(path)
    source = state.get("source_dtype")
    run_config = state.get("run_config") or {}
    lora = (run_config.get("train") or {}).get("finetune") in ("lora", "qlora")
    if source is None and not lora:
        run_model = run_config.get("model") or {}
        source = source_dtype(run_model["path"]) if run_model.get("path") else None
    try:
        return export_dtype(dtype, source)
    except ValueError as exc:
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


def export_hf_from_checkpoint(
    path: Path, out_dir: Path, *, dtype: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Progress = NO_PROGRESS,
) -> Path:
    """A Hugging Face model directory made from a verified checkpoint, streamed.

    The weights (keyed by parameter name, tied tensors once) go into safetensors shards of
    about `max_shard_bytes`, cast to `dtype` (`--export-dtype`; `auto`: the dtype of the
    weights the run started from, recorded in state.json) a chunk at a time by
    `tierlm.models.export.write_hf_model`, next to config.json (recording that dtype), the
    tokenizer and generation_config.json. No more than a chunk of a tensor is in RAM (an FSDP
    run's dcp shards: about a GiB of full tensors at a time). Written into a temporary sibling
    and renamed into place, like the checkpoint itself. `progress` shows the bytes written.
    """
    verify_checkpoint(path)
    manifest = _manifest(path)
    state = read_state(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: config.json is unreadable: {exc}") from None
    run_config = state.get("run_config") or {}
    if (run_config.get("train") or {}).get("finetune") in ("lora", "qlora"):
        return _export_lora(path, out_dir, state, config, manifest, dtype, max_shard_bytes,
                            progress)
    weights: TensorFiles | DCPTensors
    if state.get("tensors") == "dcp":
        weights = DCPTensors(path, "model.", 0)
    else:
        weights = TensorFiles(path / n for n in sorted(manifest) if _MODEL_SHARD.fullmatch(n))
        listed = state.get("tensor_names")
        model_files = {k: v for k, v in listed.items() if _MODEL_SHARD.fullmatch(k)} if (
            isinstance(listed, dict)) else listed
        _check_tensor_names(path, {"tensor_names": model_files}, weights.names_by_file())
    check_weight_names(_parameter_shapes(path), weights, path)
    sources = (_dcp_sources(weights, sorted(weights, key=natural_key))
               if isinstance(weights, DCPTensors) else _file_sources(weights))
    others = [path / n for n in sorted(manifest)
              if not (_NOT_EXPORTED.fullmatch(n) or _MODEL_SHARD.fullmatch(n))]
    try:
        return write_hf_model(out_dir, sources, config=config, files=others,
                              dtype=checkpoint_export_dtype(path, dtype),
                              max_shard_bytes=max_shard_bytes, progress=progress)
    except ValueError as exc:  # what the checkpoint holds cannot be exported as asked
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


def _export_lora(path: Path, out_dir: Path, state: dict, config: dict, manifest: dict,
                 dtype: str, max_shard_bytes: int, progress: Progress) -> Path:
    """A LoRA run's checkpoint holds its adapters only: the export is the base (--model, or the
    preset from --seed) with them merged in (W + alpha/r * B A), tensor by tensor."""
    from tierlm.models.lora import merged_sources

    adapters = TensorFiles(path / n for n in sorted(manifest) if _MODEL_SHARD.fullmatch(n))
    others = [path / n for n in sorted(manifest)
              if not (_NOT_EXPORTED.fullmatch(n) or _MODEL_SHARD.fullmatch(n))]
    try:
        return write_hf_model(out_dir, merged_sources(state["run_config"], path, adapters),
                              config=config, files=others,
                              dtype=checkpoint_export_dtype(path, dtype),
                              max_shard_bytes=max_shard_bytes, progress=progress)
    except ValueError as exc:
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


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

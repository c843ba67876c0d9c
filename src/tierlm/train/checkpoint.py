"""Checkpoints: safetensors for tensors, JSON for the rest, a checksum manifest, atomic writes.

Layout of one checkpoint (a directory under RUN_DIR/checkpoints/):

    step_00000010/
        model[-<shard>].safetensors      weights by parameter name (tied tensors stored once)
        optimizer[-<shard>].safetensors  optimizer state, keyed "<parameter name>.<state name>"
        rng.safetensors                  torch RNG states
        config.json                      the Hugging Face model config (so the directory exports
                                         alone)
        tokenizer.json, ...              the run's tokenizer
        state.json                       step, data position, skipped steps, run config
        manifest.json                    sha256 and size of every other file

Tensors arrive in shards (`stepper.state_shards()`: one per segment for the tiered runtime, one
for the reference trainer) and each shard is written and released before the next is read, so
saving never needs the whole model in RAM: a 7B run whose state lives on disk checkpoints with
a few segments' worth of host memory. The reader likewise returns lazy mappings that read one
tensor per access. Checksums are computed from the bytes as they are written.

A checkpoint is written into a temporary sibling, fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never a torn directory; leftovers of an
interrupted write are cleaned up by `recover_checkpoints`. Only the last `keep` checkpoints are
kept. Nothing is ever unpickled on load: tensors are read from safetensors files by our own
strict reader, everything else is JSON.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierlm.crashpoints import crash_point

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: one model.safetensors and one optimizer.safetensors
MANIFEST = "manifest.json"
_PREFIX = "step_"
_STEP_DIR = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"\.(step_\d+)\.(tmp|old|del)-\d+")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# One state shard: (name, weights by parameter name, optimizer state by "<name>.<state>").
Shard = tuple[str, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]


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
    of state costs no extra RAM and the checksum needs no second read.
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
            data = _raw_bytes(t)
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

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file's header, without reading it."""
        return self._where[name].entries[name][1]

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_shards(stepper: Any) -> Iterable[Shard]:
    """A stepper's state shard by shard (`stepper.state_shards()`); a stepper without that
    method gives its whole state as one shard."""
    shards = getattr(stepper, "state_shards", None)
    if shards is not None:
        return shards()
    return iter([("", stepper.weights(), stepper.optimizer_state())])


def _shard_file(kind: str, shard: str) -> str:
    return f"{kind}-{shard}.safetensors" if shard else f"{kind}.safetensors"


def _write_contents(
    tmp: Path, shards: Iterable[Shard], model_config: Any, tokenizer: Any, state: TrainState,
    manifest: dict[str, dict[str, Any]],
) -> None:
    def record(name: str, sha_size: tuple[str, int]) -> None:
        manifest[name] = {"sha256": sha_size[0], "size_bytes": sha_size[1]}
        crash_point("checkpoint-file")

    for shard, weights, optim in shards:  # one shard in memory at a time
        for kind, tensors in (("model", weights), ("optimizer", optim)):
            name = _shard_file(kind, shard)
            if name in manifest:
                raise CheckpointError(f"two state shards are both named {shard!r}")
            record(name, write_safetensors(tmp / name, tensors))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    record("rng.safetensors", write_safetensors(tmp / "rng.safetensors", rng))
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
    for f in sorted(tmp.iterdir()):  # the small files written by other libraries
        if f.name not in manifest:
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
            manifest[f.name] = {"sha256": _sha256(f), "size_bytes": f.stat().st_size}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    with (tmp / MANIFEST).open("rb") as fh:
        os.fsync(fh.fileno())
    _fsync_dir(tmp)


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
) -> Path:
    """Write a complete checkpoint for `state.step` atomically and return its directory.

    `shards` yields (name, weights, optimizer state) keyed by the model's parameter names (tied
    tensors once), as both runtimes produce them, so either runtime can resume the other's
    checkpoint. `keep` > 0 deletes all but the newest `keep` checkpoints afterwards. A write
    that fails (disk full, I/O error) removes its temporary directory and raises
    CheckpointWriteError; the checkpoints already there are never touched by a failed write.
    Whole-state `weights` and `optimizer_state` dicts are accepted too, as one shard.
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
        _write_contents(tmp, shards, model_config, tokenizer, state, written)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            done = sum(e["size_bytes"] for e in written.values())
            raise _write_failed(exc, final, run_dir, done) from exc
        raise

    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)  # a crash between the renames: recover_checkpoints puts it back
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    if keep > 0:
        prune_checkpoints(run_dir, keep)
    return final


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
            "start without --resume or point it at a run directory with checkpoints"
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
            f"checkpoint {path}: format version {version}, this tierlm reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return state


def load_checkpoint(path: Path) -> tuple[TensorFiles, TensorFiles, dict[str, Any]]:
    """Verify a checkpoint, restore the RNG, and return (weights, optimizer state, state.json).

    Weights and optimizer state are lazy mappings: each tensor is read when accessed.
    """
    manifest = _manifest(path)
    verify_checkpoint(path)
    state = read_state(path)

    def files(kind: str) -> list[Path]:
        pattern = re.compile(rf"{kind}(-.+)?\.safetensors")
        return [path / n for n in sorted(manifest) if pattern.fullmatch(n)]

    weights, optim = TensorFiles(files("model")), TensorFiles(files("optimizer"))
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


_NOT_EXPORTED = re.compile(r"(optimizer(-.+)?|rng)\.safetensors|state\.json|" + re.escape(MANIFEST))
_MODEL_SHARD = re.compile(r"model(-.+)?\.safetensors")


def _copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Append `nbytes` of file `src` from `offset` to `dst`, in the kernel where it can."""
    while nbytes > 0:
        try:
            n = os.copy_file_range(src, dst, nbytes, offset)
        except OSError:  # e.g. across filesystems on old kernels: through a small buffer
            n = os.write(dst, os.pread(src, min(nbytes, 8 << 20), offset))
        if n <= 0:
            raise OSError(errno.EIO, "short copy")
        offset += n
        nbytes -= n


def _concat_safetensors(sources: list[Path], dst: Path) -> None:
    """One safetensors file with every tensor of `sources`: the header is built from theirs
    (their offsets shifted), the data copied range by range, so nothing passes through RAM."""
    files = [SafetensorsFile(p) for p in sources]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for f in files:
        for name, (dtype, shape, begin, end) in sorted(f.entries.items(), key=lambda e: e[1][2]):
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with dst.open("wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        out.flush()
        for f in files:
            with f.path.open("rb") as src:
                for _, _, begin, end in sorted(f.entries.values(), key=lambda e: e[2]):
                    _copy_range(src.fileno(), out.fileno(), f.data_start + begin, end - begin)


def export_hf_from_checkpoint(path: Path, out_dir: Path) -> Path:
    """A Hugging Face model directory made from a verified checkpoint, file by file.

    The weight shards already are safetensors files keyed by the model's parameter names (tied
    tensors once, as `save_pretrained` writes them); they are joined into one model.safetensors
    by copying byte ranges, next to config.json and the tokenizer. No tensor is loaded:
    exporting a 7B run needs no RAM for its weights. Written into a temporary sibling and
    renamed into place, like the checkpoint itself.
    """
    verify_checkpoint(path)
    manifest = _manifest(path)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for name in manifest:
            if not (_NOT_EXPORTED.fullmatch(name) or _MODEL_SHARD.fullmatch(name)):
                shutil.copyfile(path / name, tmp / name)  # a kernel-side copy, not via RAM
        shards = sorted(n for n in manifest if _MODEL_SHARD.fullmatch(n))
        _concat_safetensors([path / n for n in shards], tmp / "model.safetensors")
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


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
            got = weights.shape(name) if isinstance(weights, TensorFiles) else tuple(
                weights[name].shape)
            if tuple(got) != tuple(shape):
                wrong.append(f"{name} {tuple(got)} vs {tuple(shape)}")
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit this model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, shapes {wrong[:3]}); resume with the same "
            "--model/--model-size"
        )

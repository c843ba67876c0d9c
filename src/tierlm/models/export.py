"""Streamed export to a Hugging Face model directory: sharded safetensors, tensor by tensor.

`write_hf_model` writes the layout `save_pretrained` writes (`model.safetensors`, or
`model-0000i-of-0000N.safetensors` shards of about `max_shard_bytes` plus
`model.safetensors.index.json`), config.json with the exported dtype, and the files it is given
(tokenizer, generation_config.json), without ever holding the model: every shard's header is
built from the tensors' names, shapes and dtypes alone, then each tensor's values are read from
its source in chunks, cast to the export dtype and appended to the file. RAM peaks at one chunk
(a source that can only give whole tensors, e.g. torch.distributed.checkpoint shards, at what
it reads at a time), whatever the model's size.

Everything is written into a temporary sibling of the output directory, fsynced, then renamed
into place: the output directory is either the previous export or the complete new one.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierlm.crashpoints import crash_point
from tierlm.progress import NO_PHASE, NO_PROGRESS, Phase, Progress

EXPORT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
DEFAULT_MAX_SHARD_BYTES = 4 << 30
CHUNK_BYTES = 16 << 20  # source bytes read, cast and written at a time
TIED_HEAD = "lm_head.weight"  # the output embedding of every family we support
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte)\.weight$")

_DTYPE_NAMES = {  # safetensors' names
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


@dataclass(frozen=True)
class SourceTensor:
    """One tensor to export: name, shape and stored dtype, and its values on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[int], Iterator[torch.Tensor]]
    """Given a chunk size in elements, yields the values flattened, in order, as 1-D tensors of
    at most that many elements (a source that reads whole tensors may yield one piece); a piece
    may be overwritten once the next is asked for."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def source_dtype(model_dir: str | Path) -> str:
    """The dtype a Hugging Face directory stores its weights in, from config.json (`dtype`, or
    `torch_dtype` in files from transformers < 5); float32 when it names none we export."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float32"
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return name if name in EXPORT_DTYPES else "float32"


def export_dtype(option: str, source: str | None) -> torch.dtype:
    """The dtype to export in: `option` (`--export-dtype`), where `auto` means the dtype of the
    weights the run started from (`source`; float32 when unknown, as for a preset)."""
    if option == "auto":
        option = source if source in EXPORT_DTYPES else "float32"
    if option not in EXPORT_DTYPES:
        raise ValueError(f"--export-dtype {option!r}: choose auto, {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[option]


def natural_key(name: str) -> list[Any]:
    """Sort key putting layers.2 before layers.10, so shards follow the model's order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _ties_embeddings(config: Mapping[str, Any]) -> bool:
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    from transformers import AutoConfig  # the family's default

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return bool(getattr(AutoConfig.for_model(config["model_type"], **fields),
                        "tie_word_embeddings", False))


def _same_values(a: SourceTensor, b: SourceTensor) -> bool:
    # only for a checkpoint that holds both sides of a tie: whole tensors are fine here
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        torch.cat(list(a.read(a.numel))), torch.cat(list(b.read(b.numel))))


def _out_dtype(t: SourceTensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.dtype.is_floating_point else t.dtype  # integer buffers keep theirs


def _nbytes(t: SourceTensor, dtype: torch.dtype) -> int:
    return t.numel * torch.empty((), dtype=_out_dtype(t, dtype)).element_size()


def plan_shards(
    tensors: list[SourceTensor], dtype: torch.dtype, max_shard_bytes: int
) -> list[list[SourceTensor]]:
    """Tensors split, in order, into shards of at most `max_shard_bytes` of exported data (a
    larger tensor gets a shard of its own), as `save_pretrained` splits them."""
    shards: list[list[SourceTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = _nbytes(t, dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_shard(path: Path, tensors: list[SourceTensor], dtype: torch.dtype,
                 progress: Phase = NO_PHASE) -> None:
    """One safetensors file, header first (from shapes alone), then each tensor's values cast
    chunk by chunk: at most a chunk of the source and its cast are in RAM."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        out = _out_dtype(t, dtype)
        if out not in _DTYPE_NAMES:
            raise ValueError(f"cannot export {t.name} of dtype {t.dtype}")
        nbytes = _nbytes(t, dtype)
        header[t.name] = {"dtype": _DTYPE_NAMES[out], "shape": list(t.shape),
                          "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            out = _out_dtype(t, dtype)
            chunk = max(1, CHUNK_BYTES // torch.empty((), dtype=t.dtype).element_size())
            written = 0
            for piece in t.read(chunk):
                piece = piece.reshape(-1).to(out).contiguous()
                f.write(memoryview(piece.view(torch.uint8).numpy()))
                written += piece.numel()
                progress.advance(piece.numel() * piece.element_size())
            if written != t.numel:
                raise ValueError(f"{t.name}: its source gave {written} of {t.numel} values")
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named directory in `parent`, with the mode the umask gives (as every
    other directory of a run), not `tempfile.mkdtemp`'s 0700: the export it becomes is read by
    whoever may read the rest of the run."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary name {prefix}* in {parent}")


def publish_dir(tmp: Path, out_dir: Path) -> None:
    """Rename the complete `tmp` to `out_dir`. POSIX cannot rename over a non-empty directory,
    so an existing export is moved aside first and deleted after (a crash between the renames
    leaves it in the `.old` sibling)."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()  # only the unique name is wanted
        os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            os.rename(old, out_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)


def write_hf_model(
    out_dir: str | Path,
    tensors: Iterable[SourceTensor],
    *,
    config: Mapping[str, Any],
    dtype: torch.dtype,
    files: Iterable[Path] = (),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Progress = NO_PROGRESS,
) -> Path:
    """Write a Hugging Face model directory from `tensors` (keyed by parameter name, tied
    tensors once) and the model's `config` (config.json's contents) in `dtype`, with `files`
    (tokenizer files, generation_config.json) copied next to them; return `out_dir`.

    With tied embeddings `lm_head.weight` is left out, as `save_pretrained` does (it must equal
    the input embedding if it is there at all). An existing `out_dir` is replaced atomically.
    `progress` shows the weights' bytes written, as a phase named after `out_dir`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export target {str(out_dir)!r} exists and is not a directory")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    ordered = sorted(tensors, key=lambda t: natural_key(t.name))
    if _ties_embeddings(config):
        head = next((t for t in ordered if t.name == TIED_HEAD), None)
        if head is not None:
            embed = next((t for t in ordered if _INPUT_EMBEDDING.search(t.name)), None)
            if embed is None or not _same_values(head, embed):
                raise ValueError(
                    "config.tie_word_embeddings is True but lm_head.weight differs from the "
                    "input embedding; set tie_word_embeddings to false in the checkpoint's "
                    "config.json to export both matrices"
                )
            ordered.remove(head)
    shards = plan_shards(ordered, dtype, max_shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # same parent: the final rename stays on one filesystem, where it is atomic
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    total_bytes = sum(_nbytes(t, dtype) for t in ordered)
    dtype_name = str(dtype).removeprefix("torch.")
    try:
        with progress.phase(f"export {dtype_name} to {out_dir}", total_bytes, "bytes") as phase:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards):
                name = ("model.safetensors" if len(shards) == 1
                        else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
                _write_shard(tmp / name, shard, dtype, phase)
                weight_map.update((t.name, name) for t in shard)
                crash_point("export-shard")
        if len(shards) > 1:
            index = {
                "metadata": {"total_parameters": sum(t.numel for t in ordered),
                             "total_size": sum(_nbytes(t, dtype) for t in ordered)},
                "weight_map": weight_map,
            }
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # transformers 5 reads `dtype`; files from older versions may carry `torch_dtype`
        config_out = {**config, "dtype": dtype_name}
        if "torch_dtype" in config_out:
            config_out["torch_dtype"] = dtype_name
        (tmp / "config.json").write_text(
            json.dumps(config_out, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        for f in tmp.iterdir():  # shards are synced as written; the small files here
            if not f.name.endswith(".safetensors"):
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def module_tensors(model: torch.nn.Module) -> list[SourceTensor]:
    """A module's parameters (tied ones once) as export sources: for tests and for a model that
    is in RAM anyway."""
    out = []
    for name, p in model.named_parameters():
        flat = p.detach().to("cpu").reshape(-1)

        def read(chunk: int, flat: torch.Tensor = flat) -> Iterator[torch.Tensor]:
            yield from flat.split(chunk)

        out.append(SourceTensor(name, tuple(p.shape), p.dtype, read))
    return out

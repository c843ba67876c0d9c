"""Safetensors files of a checkpoint: our writer; headers read by the library, data by us.

The header of every file read is parsed and validated by the `safetensors` library
(`safe_open`). The rest is ours, for what the library does not do:

- `write_safetensors` hashes the bytes as it writes them (the manifest's sha256 needs no second
  read of a multi-GiB file) and takes each tensor's bytes straight from its memory, reading a
  disk-tier `DiskTensor` only for its own write, one at a time; `safetensors.torch.save_file`
  needs every tensor in RAM at once and returns no checksum.
- `SafetensorsFile.read` reads a tensor with a plain file read into a fresh tensor.
  `safe_open(...).get_tensor` maps the file, and every page a read touches stays in the
  process's RSS while the file is open (measured: reading a 256 MiB file tensor by tensor that
  way left RSS 260 MiB higher, ours 1 MiB), which a 7B resume that loads segment by segment
  cannot afford. `read_in_chunks` reads one tensor a byte range at a time into one reused
  buffer, for the streamed export; the library has no such read.

The files themselves are standard safetensors: the library reads what we write and we read
what it writes (tests/train/test_reliability.py checks both ways). No pickle is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tierlm.checkpoint.format import CheckpointError
from tierlm.runtime.state import opened

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


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
    """One safetensors file: its header parsed and checked by the `safetensors` library before
    any tensor is trusted, its tensors read with plain file reads (no mmap, so reading a
    checkpoint does not inflate RSS).

    `safe_open` validates the header (a known dtype per entry, offsets that tile the data
    section without gaps or overlaps, a data section that ends where the file does) and is
    closed again at once: only its header page is ever touched. Each tensor's byte range
    follows from the order of its data (`offset_keys`) and the sizes of the tensors before
    it, which that validation makes exact.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with safe_open(str(path), framework="pt") as f:
                described = [(name, f.get_slice(name)) for name in f.offset_keys()]
                described = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in described]
            with path.open("rb") as fh:
                (header_bytes,) = struct.unpack("<Q", fh.read(8))
        except (OSError, SafetensorError, struct.error) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
        self.data_start = 8 + header_bytes
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        begin = 0
        for name, dtype_name, shape in described:
            dtype = _DTYPES.get(dtype_name)
            if dtype is None:  # valid safetensors, but a dtype a checkpoint never holds
                raise CheckpointError(f"{path}: {name!r} has dtype {dtype_name}, which tierlm "
                                      "does not read")
            numel = 1
            for d in shape:
                numel *= d
            end = begin + numel * torch.empty((), dtype=dtype).element_size()
            self.entries[name] = (dtype, shape, begin, end)
            begin = end

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



def read_in_chunks(f: SafetensorsFile, name: str, chunk: int) -> Iterator[torch.Tensor]:
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


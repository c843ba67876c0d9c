"""Host buffers the disk tier (tierlm.memory.disk) can read and write: `aligned_empty` (an
O_DIRECT buffer: pinned, or a mapping of its own) and `mapped_empty` (an anonymous mapping,
unmapped when freed, outside malloc). The store, the pinned arena and offloaded activations
allocate from them too."""

from __future__ import annotations

import mmap

import torch

# O_DIRECT needs buffer address, file offset and length aligned to the logical block size of the
# device (512 or 4096); 4096 covers both and is the page size.
ALIGN_BYTES = 4096


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


MAPPED_MIN_BYTES = 128 << 10
"""Unpinned host buffers from this size up are mappings of their own (`mapped_empty`)."""


def mapped_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised bytes (as uint8) in an anonymous mapping of their own, unmapped
    when the last tensor viewing them is freed. This is how the runtime's host buffers (the
    store's state, the pinned arena's blocks, offloaded activations) leave malloc: glibc keeps
    freed heap memory and, with its default dynamic M_MMAP_THRESHOLD, serves buffers of a size
    it has seen freed from the heap, so RSS would not follow the ledger; a process-wide lower
    threshold would (it did) but makes every activation and gradient buffer of torch a fresh
    mapping the kernel zero-fills each step. Page aligned, so also an O_DIRECT buffer."""
    # torch.frombuffer holds the mmap object until the storage is freed; the mmap object's
    # deallocation unmaps it (nothing else holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised 1-D tensor usable as an O_DIRECT buffer.

    Its data_ptr is ALIGN_BYTES-aligned and its allocation extends to the next multiple of
    ALIGN_BYTES past the data. pin=None pins only when CUDA is available (pinning raises on a
    CPU-only build). Unpinned, from MAPPED_MIN_BYTES up it is a mapping of its own
    (`mapped_empty`): freeing it gives its pages back to the kernel at once.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    if pin is None:
        pin = torch.cuda.is_available()
    padded_bytes = round_up(max(numel * dtype.itemsize, 1), ALIGN_BYTES)
    if not pin and padded_bytes >= MAPPED_MIN_BYTES:
        return mapped_empty(padded_bytes).view(dtype)[:numel]
    raw = torch.empty(padded_bytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=pin)
    offset = -raw.data_ptr() % ALIGN_BYTES
    return raw[offset : offset + padded_bytes].view(dtype)[:numel]

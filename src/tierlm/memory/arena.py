"""The pinned arena: the host RAM a run pins for PCIe copies, allocated once and cut into buffers.

Why not torch's pinned allocator: it rounds every request up to a power of two and keeps what it
pinned for the life of the process, and no ledger sees it. A 64 MiB staging chunk asked 4 KiB
larger (for O_DIRECT alignment) was pinned as 128 MiB. Pinned pages cannot be swapped, so what
a run pins is a budget of its own (train/preflight.py checks it against RAM).

Here a run's pinned bytes are sized by its plan (tierlm.runtime.pinned, the rule the planner's
replay counts) and sub-allocated: every buffer starts on an ALIGN_BYTES boundary and takes its
size rounded up to ALIGN_BYTES (`footprint_bytes`, what the ledger's pinned class counts), so
O_DIRECT works on any of them and nothing doubles; frees coalesce with their free neighbours and
a request takes the smallest free range that holds it.

Two regions, by what a buffer is (`PERSISTENT_CLASSES`): the copies streamed host-tier segments
cross from, held for the whole run, and the step's staging, landing ring and parked
activations, all free again between steps. Each region is one block, allocated once for a run
whose step keeps its shape; a step that needs more staging than any before (more micro-batches
than planned) grows the step's block between steps, while nothing is cut from it, and a
persistent copy that outgrows its plan (an fp8 layer switched to bf16 widens its segment's
compute copy) gets a block of its own, of its size. Running out of the step's block is an
error: the plan's count was short.

On CUDA a block is registered with the driver (`cudaHostRegister`), so copies from and to it run
as asynchronous DMA; on a CPU-only build the same arena is plain (mapped) memory, and the CPU tests
exercise the allocator a GPU run uses. A buffer freed while a copy may still read or write it
comes back only once the event given with it (recorded after that copy) has passed.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from tierlm.memory.disk import ALIGN_BYTES, aligned_empty
from tierlm.memory.tiers import TensorClass

PERSISTENT_CLASSES = frozenset({TensorClass.MASTER, TensorClass.COMPUTE})
"""Pinned buffers held for the run: the weights a streamed host-tier segment crosses from (its
compute copy, or its fp32 master). Every other pinned class is the step's own."""


def footprint_bytes(nbytes: int) -> int:
    """Arena bytes a buffer of `nbytes` takes: whole ALIGN_BYTES units (none for 0 bytes)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True, kw_only=True)
class PinnedBytes:
    """What a run pins (footprints): the persistent region and the step's peak beside it."""

    persistent_bytes: int
    transient_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.transient_bytes


class ArenaFullError(RuntimeError):
    """A pinned buffer did not fit the arena: the plan's pinned bytes undercount what the engine
    holds (a planner or engine bug, not a user error)."""


class _Done(Protocol):  # a CUDA event, or anything that says when a copy has finished
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class FreeList:
    """Free ranges of [0, capacity): best fit among the holes, the top (the free range that
    ends at the capacity) only when no hole holds a request, split on take, coalesced on give.
    Offsets only: the arena maps them onto memory.

    Keeping the top for last is what lets a replay size an arena: with `grow` the list has no
    end and takes from above its `capacity_bytes` (raising it) where the top is too small, so
    replaying a sequence of takes and gives yields the capacity that sequence needs; a list of
    that capacity given the same sequence makes the same choices and never runs out."""

    def __init__(self, capacity_bytes: int, *, grow: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.grow = grow
        self._starts: list[int] = [0] if capacity_bytes else []
        self._sizes: list[int] = [capacity_bytes] if capacity_bytes else []

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes)

    @property
    def largest_bytes(self) -> int:
        return max(self._sizes, default=0)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, by offset."""
        return list(zip(self._starts, self._sizes, strict=True))

    def _top(self) -> int | None:
        """Index of the free range that ends at the capacity, if any."""
        last = len(self._starts) - 1
        if last >= 0 and self._starts[last] + self._sizes[last] == self.capacity_bytes:
            return last
        return None

    def take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` taken from the smallest hole that holds them (the lowest of
        equals), else from the top; None where neither does (never with `grow`)."""
        top = self._top()
        best = None
        for i, size in enumerate(self._sizes):
            if i != top and size >= nbytes and (best is None or size < self._sizes[best]):
                best = i
        if best is None and top is not None and (self.grow or self._sizes[top] >= nbytes):
            best = top
            if self._sizes[top] < nbytes:  # grow: the top extends past the capacity
                self.capacity_bytes += nbytes - self._sizes[top]
                self._sizes[top] = nbytes
        if best is None:
            if not self.grow:
                return None
            self.capacity_bytes += nbytes
            return self.capacity_bytes - nbytes
        offset = self._starts[best]
        if self._sizes[best] == nbytes:
            del self._starts[best], self._sizes[best]
        else:
            self._starts[best] += nbytes
            self._sizes[best] -= nbytes
        return offset

    def give(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        before = self._starts[i - 1] + self._sizes[i - 1] if i > 0 else None  # its end
        after = self._starts[i] if i < len(self._starts) else None
        if (before is not None and before > offset) or (
                after is not None and offset + nbytes > after):
            raise AssertionError(f"pinned arena: range [{offset}, {offset + nbytes}) given back "
                                 "overlaps a free range (freed twice?)")
        if before == offset:  # joins the range before it
            i -= 1
            self._sizes[i] += nbytes
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, nbytes)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]


class ArenaReplay:
    """The arena's two regions as offsets only, growing: what a replay of a step's pinned
    allocations (tierlm.runtime.byte_replay._CountingStore) cuts them from. Its capacities are the
    arena that sequence needs, fragmentation included (`pinned_bytes`)."""

    def __init__(self) -> None:
        self._regions = {True: FreeList(0, grow=True), False: FreeList(0, grow=True)}

    def take(self, cls: TensorClass, nbytes: int) -> int:
        return self._regions[cls in PERSISTENT_CLASSES].take(footprint_bytes(nbytes))

    def give(self, cls: TensorClass, nbytes: int, offset: int) -> None:
        if footprint_bytes(nbytes):
            self._regions[cls in PERSISTENT_CLASSES].give(offset, footprint_bytes(nbytes))

    def pinned_bytes(self) -> PinnedBytes:
        return PinnedBytes(persistent_bytes=self._regions[True].capacity_bytes,
                           transient_bytes=self._regions[False].capacity_bytes)


class _Block:
    """One region's memory and its free list."""

    def __init__(self, name: str, capacity_bytes: int, pin: bool) -> None:
        self.name = name
        self.capacity_bytes = footprint_bytes(capacity_bytes)
        # 4 KiB aligned at its start, so every offset the free list gives is aligned too
        self.raw = aligned_empty(self.capacity_bytes, torch.uint8, pin=False)
        self.registered = False
        if pin and self.capacity_bytes:
            _register(self.raw.data_ptr(), self.capacity_bytes)
            self.registered = True
        self.free = FreeList(self.capacity_bytes)
        self.held: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, footprint)
        self.pending: deque[tuple[_Done, int, int]] = deque()  # freed, a copy may still use it

    def used_bytes(self) -> int:
        return sum(n for _, n in self.held.values()) + sum(n for _, _, n in self.pending)

    def reclaim(self, wait: bool) -> bool:
        """Give back pending ranges whose copies are done (`wait`: the oldest, waiting for
        it). Returns whether anything came back."""
        back = False
        while self.pending:
            done, offset, nbytes = self.pending[0]
            if not done.query():
                if not wait:
                    break
                done.synchronize()
                wait = False
            self.pending.popleft()
            self.free.give(offset, nbytes)
            back = True
        return back

    def close(self) -> None:
        while self.pending:
            self.reclaim(wait=True)
        if self.registered:
            _unregister(self.raw.data_ptr())
            self.registered = False


class PinnedArena:
    """The run's pinned host buffers: `alloc` cuts one from its region, `free` returns it."""

    def __init__(self, pinned: PinnedBytes, *, pin: bool | None = None) -> None:
        """`pin`: register the blocks with CUDA (default: where CUDA is available)."""
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._persistent = [_Block("persistent", pinned.persistent_bytes, self.pin)]
        self._transient = _Block("step", pinned.transient_bytes, self.pin)
        self.peak_bytes = 0  # footprints held at once, both regions
        # the training thread cuts the step's buffers; the update worker may re-cut a compute
        # copy whose format changed (tierlm.precision.streaming.ComputeCopies.refresh)
        self._lock = threading.RLock()

    @property
    def capacity_bytes(self) -> int:
        return self.persistent_bytes + self._transient.capacity_bytes

    @property
    def persistent_bytes(self) -> int:
        return sum(b.capacity_bytes for b in self._persistent)

    @property
    def transient_bytes(self) -> int:
        return self._transient.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return sum(b.used_bytes() for b in self._blocks())

    def _blocks(self) -> Iterable[_Block]:
        return (*self._persistent, self._transient)

    def owns(self, t: torch.Tensor) -> bool:
        with self._lock:
            return any(t.data_ptr() in b.held for b in self._blocks())

    @staticmethod
    def _take(block: _Block, size: int) -> int | None:
        block.reclaim(wait=False)
        offset = block.free.take(size)
        while offset is None and block.reclaim(wait=True):
            offset = block.free.take(size)
        return offset

    def alloc(self, numel: int, dtype: torch.dtype, cls: TensorClass) -> torch.Tensor:
        """An uninitialised 1-D tensor of `numel` `dtype` elements at an ALIGN_BYTES-aligned
        address, its footprint taken from `cls`'s region."""
        with self._lock:
            return self._alloc(numel, dtype, cls)

    def _alloc(self, numel: int, dtype: torch.dtype, cls: TensorClass) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        size = footprint_bytes(nbytes)
        if size == 0:
            return torch.empty(0, dtype=dtype)
        if cls in PERSISTENT_CLASSES:
            found = next(((b, o) for b in self._persistent
                          if (o := self._take(b, size)) is not None), None)
            if found is None:
                # a copy the plan did not size (an fp8 layer switched to bf16 grows its
                # segment's compute copy): a block of its own, exactly its size
                self._persistent.append(_Block("persistent", size, self.pin))
                found = (self._persistent[-1], self._persistent[-1].free.take(size))
            block, offset = found
        else:
            block = self._transient
            offset = self._take(block, size)
        if offset is None:
            raise ArenaFullError(
                f"pinned arena: {cls} asked for {nbytes:,} bytes ({size:,} with alignment) in the "
                f"{block.name} region of {block.capacity_bytes:,} bytes ({self.capacity_bytes:,} "
                f"in all), which has {block.free.free_bytes:,} free, the largest range "
                f"{block.free.largest_bytes:,}: the plan's pinned bytes "
                "(tierlm.runtime.pinned.step_pinned_bytes) undercount what the engine holds")
        t = block.raw[offset : offset + size].view(dtype)[:numel]
        block.held[t.data_ptr()] = (offset, size)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return t

    def free(self, t: torch.Tensor, done: _Done | None = None) -> None:
        """Return `t` (from `alloc`). `done`: passes once no copy reads or writes it any more
        (None: already so); until then its range is not handed out again."""
        with self._lock:
            self._free(t, done)

    def _free(self, t: torch.Tensor, done: _Done | None) -> None:
        for block in self._blocks():
            held = block.held.pop(t.data_ptr(), None)
            if held is not None:
                if done is None:
                    block.free.give(*held)
                else:
                    block.pending.append((done, *held))
                return
        raise ValueError("pinned arena: freeing a tensor the arena did not give out")

    def reserve_transient(self, nbytes: int) -> bool:
        """Grow the step's region to at least `nbytes` (a step of a larger shape than planned),
        only while nothing is cut from it. Returns whether it grew."""
        with self._lock:
            return self._reserve_transient(nbytes)

    def _reserve_transient(self, nbytes: int) -> bool:
        need = footprint_bytes(nbytes)
        block = self._transient
        if need <= block.capacity_bytes:
            return False
        if block.held:
            raise ArenaFullError(
                f"pinned arena: a step needs {need:,} bytes of pinned staging but the step region "
                f"({block.capacity_bytes:,} bytes) still holds {len(block.held)} buffers between "
                "steps")
        block.close()
        self._transient = _Block("step", need, self.pin)
        return True

    def close(self) -> None:
        """Wait for pending copies and unregister the blocks (the memory stays valid for tensors
        that still view it, unpinned)."""
        for block in self._blocks():
            block.close()


def _register(ptr: int, nbytes: int) -> None:
    """Page-lock `nbytes` at `ptr` for the GPU's DMA engines, without torch's caching host
    allocator (which would round the request up to a power of two)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))  # cudaHostRegisterDefault
    if err != 0:
        raise RuntimeError(f"pinned arena: cudaHostRegister of {nbytes:,} bytes failed with CUDA "
                           f"error {err} (the OS may limit locked memory: ulimit -l)")


def _unregister(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"pinned arena: cudaHostUnregister failed with CUDA error {err}")

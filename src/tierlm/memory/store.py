"""The store: the one place that allocates managed tensors and moves them between tiers.

Every allocation and move reports to the ledger. Host buffers are 4096-byte aligned (so the disk
tier can use O_DIRECT on them); those that cross PCIe are asked for `pinned` and cut from the
run's pinned arena (tierlm.memory.arena), the rest (optimizer state, host gradients, masters a
compute copy streams for) stay pageable. Unpinned host buffers, and a CPU device's, are
mappings of their own (tierlm.memory.disk.mapped_empty): freed, their pages leave RSS at once,
so RSS follows the ledger while torch's own buffers keep glibc's heap. Device copies go
through the device (tierlm.memory.device: a stream per direction on CUDA, virtual time on a
simulated device). On a CPU-only machine the device is the CPU itself: copies are plain
memcpys, still accounted as H2D/D2H so the ledger shows what a GPU run would move.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tierlm.crashpoints import crash_point
from tierlm.memory.arena import PinnedArena, PinnedBytes
from tierlm.memory.device import (
    AFTER_COMPUTE,
    Device,
    as_device,
    nbytes_of,  # noqa: F401  (re-exported: its old home)
)
from tierlm.memory.disk import DiskTier, aligned_empty
from tierlm.memory.ledger import Ledger
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.trace import NO_TRACER, NoTracer, Tracer


class Store:
    def __init__(
        self,
        device: torch.device | Device,
        ledger: Ledger | None = None,
        offload_dir: str | Path | None = None,
        tracer: Tracer | NoTracer = NO_TRACER,
    ) -> None:
        # every copy, wait and event goes through the device (tierlm.memory.device)
        self.dev = as_device(device, tracer)
        self.device = self.dev.torch_device  # where device-tier tensors are allocated
        self.tracer = tracer  # the step timeline (tierlm.trace): every copy and request
        self.ledger = ledger or Ledger()
        self.cuda = self.device.type == "cuda"
        self._disk: DiskTier | None = None
        self._offload_dir = Path(offload_dir) if offload_dir else None
        self._disk_files: dict[str, int] = {}
        # The run's pinned arena (`open_arena`, sized by the plan); until one is open, pinned
        # buffers come one by one from torch's pinned allocator (a store used on its own).
        self.arena: PinnedArena | None = None
        self._pinned: set[int] = set()  # data_ptr of every pinned buffer held (arena or not)

    # -- allocation ----

    def open_arena(self, pinned: PinnedBytes) -> PinnedArena:
        """Allocate the run's pinned arena (before the first pinned buffer is asked for)."""
        if self.arena is not None or self._pinned:
            raise ValueError("the store's pinned arena is opened once, before any pinned buffer")
        self.arena = PinnedArena(pinned, pin=self.cuda)
        return self.arena

    def alloc(
        self, tier: Tier, cls: TensorClass, numel: int, dtype: torch.dtype = torch.float32, *,
        pinned: bool = False,
    ) -> torch.Tensor:
        """A managed buffer of `numel` `dtype` elements on `tier`. `pinned` (host only): it is a
        source or destination of PCIe copies, cut from the pinned arena."""
        if pinned and tier != Tier.HOST:
            raise ValueError(f"only host buffers are pinned, not a {tier} {cls} buffer")
        if tier == Tier.DEVICE and self.device.type == "cpu":
            # the "device" is RAM (a CPU-only run, or a simulated GPU): its buffers are the
            # runtime's own mappings too, so RSS follows the device tier's ledger as well
            t = aligned_empty(numel, dtype, pin=False)
        elif tier == Tier.DEVICE:
            t = torch.empty(numel, dtype=dtype, device=self.device)
        elif tier == Tier.HOST and pinned:
            t = (self.arena.alloc(numel, dtype, cls) if self.arena is not None
                 else aligned_empty(numel, dtype, pin=self.cuda))
            if t.numel():
                self._pinned.add(t.data_ptr())
        elif tier == Tier.HOST:
            t = aligned_empty(numel, dtype, pin=False)
        else:
            raise ValueError("disk space is allocated with write_file")
        self.ledger.allocate(tier, cls, nbytes_of(t), pinned=pinned)
        return t

    def zeros(self, tier: Tier, cls: TensorClass, numel: int, *, pinned: bool = False
              ) -> torch.Tensor:
        return self.alloc(tier, cls, numel, pinned=pinned).zero_()

    def free(self, tier: Tier, cls: TensorClass, t: torch.Tensor) -> None:
        pinned = tier == Tier.HOST and t.numel() > 0 and t.data_ptr() in self._pinned
        if pinned:
            self._pinned.discard(t.data_ptr())
            if self.arena is not None and self.arena.owns(t):
                # an asynchronous copy may still read or write it: its range comes back once
                # the copies queued so far have finished
                self.arena.free(t, self.dev.copies_done())
        # a pinned buffer of no bytes has no footprint: released unpinned, the same
        self.ledger.release(tier, cls, nbytes_of(t), pinned=pinned)

    # -- device <-> host --------------------------------------------------------------------------

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, what: str = "", *,
                  after: Sequence[Any] | None = AFTER_COMPUTE) -> Any:
        """Copy host -> device (tierlm.memory.device: `after` the events it waits for; compute
        must `wait` for the returned event before reading `dst`). `what` names it in the
        trace."""
        return self._copy(dst, src, Link.H2D, what, after)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, what: str = "", *,
                after: Sequence[Any] | None = AFTER_COMPUTE) -> Any:
        """Copy device -> host after `after` (AFTER_COMPUTE: the compute queued so far, which
        wrote `src`)."""
        return self._copy(dst, src, Link.D2H, what, after)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, link: Link, what: str,
              after: Sequence[Any] | None) -> Any:
        nbytes = nbytes_of(src)
        t0 = time.perf_counter()
        event = self.dev.copy(dst, src, link, what, after=after)
        # an asynchronous copy is timed by its own events (the device's), not here
        self.ledger.record_move(link, nbytes, 0.0 if self.dev.asynchronous
                                else time.perf_counter() - t0)
        return event

    def wait(self, event: Any, what: str = "") -> None:
        """Make compute wait for the copy `event` marks (the device reads what it wrote); the
        calling thread does not block."""
        self.dev.wait(event, what)

    def wait_host(self, event: Any, what: str = "") -> None:
        """Block the calling thread until the copy `event` marks is done: the CPU is about to
        read the host buffer it wrote, or to reuse the one it read. Only that copy (and what it
        waited for) is waited for, not the work queued since."""
        self.dev.wait_host(event, what)

    # -- disk ----

    @property
    def disk(self) -> DiskTier:
        if self._disk is None:
            if self._offload_dir is None:
                raise ValueError("the disk tier needs --offload-dir")
            self._disk = DiskTier(self._offload_dir, tracer=self.tracer)
        return self._disk

    def disk_paths(self) -> list[Path]:
        """The disk tier's files this store has written: what a run deletes at its end."""
        if self._offload_dir is None:
            return []
        return [self._offload_dir / name for name in self._disk_files]

    def reserve_file(self, name: str, nbytes: int, cls: TensorClass) -> None:
        """Count file `name`'s bytes on the disk tier before it is written in parts
        (`write_file` with offsets)."""
        if name not in self._disk_files:
            self.ledger.allocate(Tier.DISK, cls, nbytes)
            self._disk_files[name] = nbytes

    def write_file(
        self, name: str, src: torch.Tensor, cls: TensorClass, offset_bytes: int | None = None
    ) -> Future[None]:
        """Write `src` to the disk tier's file `name` (the first write allocates its bytes), or
        with `offset_bytes` into a part of a file written whole before."""
        size = nbytes_of(src)
        if offset_bytes is not None:
            if offset_bytes + size > self._disk_files.get(name, 0):
                raise ValueError(f"write_file({name!r}) at {offset_bytes}: past the end of the "
                                 "file's bytes (reserve_file or write it whole first)")
        elif name not in self._disk_files:
            self.ledger.allocate(Tier.DISK, cls, size)
            self._disk_files[name] = size
        t0 = time.perf_counter()
        request = self.disk.write(name, src, offset_bytes)
        fut = self.dev.io(request, Link.DISK_WRITE, size, name)
        request.add_done_callback(
            lambda f: self.ledger.record_move(Link.DISK_WRITE, size, _busy_s(f, t0)))
        # test-only (tests/checkpoint/test_kill.py): the bytes are in flight
        crash_point("disk-write")
        return fut

    def read_file(self, name: str, dst: torch.Tensor, offset_bytes: int = 0) -> Future[None]:
        size = nbytes_of(dst)
        t0 = time.perf_counter()
        request = self.disk.read(name, dst, offset_bytes)
        fut = self.dev.io(request, Link.DISK_READ, size, name)
        request.add_done_callback(
            lambda f: self.ledger.record_move(Link.DISK_READ, size, _busy_s(f, t0)))
        return fut

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
        if self.arena is not None:
            self.arena.close()


def _busy_s(request: Future, submitted_s: float) -> float:
    """A disk request's own time (tierlm.memory.disk sets it: from its first chunk starting, not
    its wait in the queue), else the time since it was submitted."""
    return getattr(request, "busy_s", time.perf_counter() - submitted_s)

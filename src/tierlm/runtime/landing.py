"""Adding a device gradient into a host buffer (`host += dev`) through a ring of host staging.

A GPU cannot add its memory into host RAM: the gradient crosses PCIe into host staging first
and the CPU adds it from there. Staging the whole gradient would hold a second copy of a
segment's gradient in RAM (a 7B block: ~800 MB, pinned) that no plan counts. Instead the
gradient crosses in chunks through `landing_staging_numel` elements (tierlm.runtime.schedule,
the rule the planner's replay counts too): while the CPU adds chunk i, chunk i+1's copy is in
flight on the device-to-host stream. The engine runs each landing into host RAM on a worker of
its own (the training thread goes on issuing the backward), its copies ordered after the
gradient by an event. On a CPU-only machine the copy is a memcpy and the ring
runs in turn; either way the arithmetic is the elementwise `host += dev`, chunk by chunk, so
the sum is bitwise what one `host.add_(dev)` gives.

The ring is the step's (`LandingRing`), not the landing's: taken from the store at the step's
first landing that adds into host RAM, sized for its largest (`landing_ring_numel`), reused by
every later one and released when the step's sweep ends. A fresh ring per landing cost more than
the adds it served (its pages fault in again each time; on CUDA a fresh pinned allocation is
costlier still); the planner's replay holds the ring for the same span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierlm.memory.device import AFTER_COMPUTE
from tierlm.memory.placement import chunk_ranges
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.schedule import landing_staging_numel


class LandingRing:
    """The host staging every gradient landing of one step adds through (`add_to_host`):
    `numel` elements (tierlm.runtime.schedule.landing_ring_numel), allocated through the store
    on the first `hold` and held until `release`. As a context manager it is released on
    leaving the block, however the block ends. The planner's replay holds one over its counting
    store the same way."""

    def __init__(self, store: Store, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.store, self.numel, self.dtype = store, numel, dtype
        self._buf: torch.Tensor | None = None

    def hold(self) -> torch.Tensor:
        """The ring's buffer, taken from the store on the first call."""
        if self._buf is None:
            # the D2H copies land in it: pinned
            self._buf = self.store.alloc(Tier.HOST, TensorClass.STAGING, self.numel, self.dtype,
                                         pinned=True)
        return self._buf

    def release(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self.store.free(Tier.HOST, TensorClass.STAGING, buf)

    def __enter__(self) -> LandingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def add_to_host(
    store: Store, ring: LandingRing, host: torch.Tensor, dev: torch.Tensor, chunk_numel: int,
    what: str = "", after: Sequence[Any] | None = AFTER_COMPUTE,
) -> None:
    """`host += dev` for a host buffer and a device tensor of the same length, through the first
    `landing_staging_numel(dev.numel(), chunk_numel)` elements of the step's `ring`. Returns
    once every chunk is added: no copy still reads `dev` (the caller may free it) or writes the
    ring."""
    numel = dev.numel()
    if numel == 0:
        return
    need = landing_staging_numel(numel, chunk_numel)
    if need > ring.numel or ring.dtype != dev.dtype:
        raise ValueError(
            f"landing {what or 'a gradient'} of {numel} {dev.dtype} elements needs a landing "
            f"ring of {need} {dev.dtype} elements; the step holds {ring.numel} {ring.dtype} "
            "(tierlm.runtime.schedule.landing_ring_numel sizes it from the step's landings)")
    ranges = chunk_ranges(numel, chunk_numel)
    bufs = ring.hold()[:need].split(min(numel, chunk_numel))

    def copy(k: int):
        lo, n = ranges[k]
        return store.to_host(bufs[k % len(bufs)][:n], dev.narrow(0, lo, n), what, after=after)

    pending = copy(0)
    for k, (lo, n) in enumerate(ranges):
        # the other buffer's chunk was added in the previous turn: it takes the next copy
        following = copy(k + 1) if k + 1 < len(ranges) else None
        store.wait_host(pending)  # the CPU reads chunk k once its copy has landed
        # an add reads two buffers and writes one: 1.5 memcpys of the chunk
        with store.dev.cpu_work(f"add {what}", moved_bytes=3 * n * dev.element_size() // 2):
            host.narrow(0, lo, n).add_(bufs[k % len(bufs)][:n])
        pending = following

"""Adding a device gradient into a host buffer (`host += dev`) through a ring of host staging.

A GPU cannot add its memory into host RAM: the gradient crosses PCIe into host staging first
and the CPU adds it from there. Staging the whole gradient would hold a second copy of a
segment's gradient in RAM (a 7B block: ~800 MB, pinned) that no plan counts. Instead the
gradient crosses in chunks through `landing_staging_numel` elements (tierlm.runtime.schedule,
the rule the planner's replay counts too): while the CPU adds chunk i, chunk i+1's copy is in
flight on the store's copy stream. On a CPU-only machine the copy is a memcpy and the ring
runs in turn; either way the arithmetic is the elementwise `host += dev`, chunk by chunk, so
the sum is bitwise what one `host.add_(dev)` gives.
"""

from __future__ import annotations

import torch

from tierlm.memory.placement import chunk_ranges
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.schedule import landing_staging_numel


def add_to_host(
    store: Store, host: torch.Tensor, dev: torch.Tensor, chunk_numel: int, what: str = ""
) -> None:
    """`host += dev` for a host buffer and a device tensor of the same length, through host
    staging of `landing_staging_numel(dev.numel(), chunk_numel)` elements. Returns once every
    chunk is added: no copy still reads `dev` (the caller may free it) or writes the staging."""
    numel = dev.numel()
    if numel == 0:
        return
    ranges = chunk_ranges(numel, chunk_numel)
    ring_t = store.alloc(Tier.HOST, TensorClass.STAGING,
                         landing_staging_numel(numel, chunk_numel), dev.dtype)
    ring = ring_t.split(min(numel, chunk_numel))

    def copy(k: int):
        lo, n = ranges[k]
        return store.to_host(ring[k % len(ring)][:n], dev.narrow(0, lo, n), what)

    try:
        pending = copy(0)
        for k, (lo, n) in enumerate(ranges):
            # the other buffer's chunk was added in the previous turn: it takes the next copy
            following = copy(k + 1) if k + 1 < len(ranges) else None
            store.wait_host(pending)  # the CPU reads chunk k once its copy has landed
            host.narrow(0, lo, n).add_(ring[k % len(ring)][:n])
            pending = following
    finally:
        store.free(Tier.HOST, TensorClass.STAGING, ring_t)

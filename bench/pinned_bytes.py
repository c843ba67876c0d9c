#!/usr/bin/env python3
"""Pinned host bytes of a plan, before and after the pinned arena (issue R, item 4).

Before: every host buffer came from `aligned_empty`, pinned by torch's caching host allocator
whenever CUDA existed (optimizer state and host gradients too), each request its size plus
4 KiB rounded up to a power of two, and freed blocks kept in torch's cache. After: only the
buffers PCIe copies use are pinned, cut from one arena in whole 4 KiB units
(tierlm.memory.arena), sized by the planner's replay (tierlm.runtime.pinned).

This plans the configuration given on the command line (as `tierlm plan` does, no training),
replays the plan's step over byte counts and prints, per tensor class: today's pinned bytes at
the step's peak and each class's own peak (their sum: what torch's cache keeps, at least), and
the arena's. Plan only; nothing is allocated.

    python bench/pinned_bytes.py --model-size 7b --hardware rtx4090 --host-memory 64GiB \\
        --disk-budget 200GiB --batch-size 4 --seq-len 2048 --grad-accum-steps 8 --precision bf16

Results: docs/results/7b-design-point.md.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

from tierlm.cli import build_parser, config_from_args
from tierlm.memory.arena import ArenaReplay
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import gib
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.plan.inputs import hardware_for, make_plan, model_config_for
from tierlm.precision.choice import resolve_precision
from tierlm.runtime.byte_replay import _simulate


def torch_pinned_bytes(nbytes: int) -> int:
    """What torch's pinned allocator held for one `aligned_empty` of `nbytes`: the request
    (4 KiB over, for alignment) rounded up to a power of two."""
    return 0 if nbytes == 0 else 1 << math.ceil(math.log2(nbytes + 4096))


class TodayLedger(Ledger):
    """A ledger that also counts every host allocation as today's code pinned it. The replay
    counts some copies as one allocation that the engine makes as several buffers: a segment's
    optimizer state (`slots` buffers) and the read-ahead's master and slots (1 + `slots`)."""

    def __init__(self, slots: int, read_ahead_sizes: set[int]) -> None:
        super().__init__()
        self.slots, self.read_ahead_sizes = slots, read_ahead_sizes
        self.today: dict[TensorClass, int] = defaultdict(int)
        self.today_class_peak: dict[TensorClass, int] = defaultdict(int)
        self.today_peak = 0
        self.today_at_peak: dict[TensorClass, int] = {}

    def _buffers(self, cls: TensorClass, nbytes: int) -> int:
        if cls == TensorClass.OPTIM:
            return self.slots
        return 1 + self.slots if cls == TensorClass.STAGING and nbytes in self.read_ahead_sizes \
            else 1

    def _today(self, cls: TensorClass, nbytes: int) -> int:
        k = self._buffers(cls, nbytes)
        return k * torch_pinned_bytes(nbytes // k)

    def allocate(self, tier, cls, nbytes, *, pinned=False):
        super().allocate(tier, cls, nbytes, pinned=pinned)
        if tier == Tier.HOST:
            self.today[cls] += self._today(cls, nbytes)
            self.today_class_peak[cls] = max(self.today_class_peak[cls], self.today[cls])
            total = sum(self.today.values())
            if total > self.today_peak:
                self.today_peak, self.today_at_peak = total, dict(self.today)

    def release(self, tier, cls, nbytes, *, pinned=False):
        super().release(tier, cls, nbytes, pinned=pinned)
        if tier == Tier.HOST:
            self.today[cls] -= self._today(cls, nbytes)


def main() -> None:
    args = build_parser().parse_args(["plan", *sys.argv[1:]])
    cfg = config_from_args(args)
    hw = hardware_for(cfg)
    precision = resolve_precision(cfg.precision, None, hw).mode
    p, shape, train = make_plan(cfg, model_config_for(cfg), hw, precision, advise=False)
    slots = round(sum(shape.optim_state_bytes) / max(1, 4 * shape.n_params)) or 1
    ledger = TodayLedger(slots, {shape.update_state_bytes(s) for s in range(len(shape.names))})
    arena = ArenaReplay()
    _simulate(shape, train, p.placements, p.order, p.keep_resident_activations,
              p.boundary_on_host, ledger=ledger, readahead=p.readahead, arena=arena)
    print(f"plan: {p.tier_counts()} segments per state tier, order {p.order}, boundary "
          f"activations on the {'host' if p.boundary_on_host else 'device'}; host tier peak "
          f"{gib(ledger.peak_tier_bytes[Tier.HOST])} in the sweep")
    print()
    print("| class | today: at the step's peak | today: class peak | arena: class peak |")
    print("| --- | ---: | ---: | ---: |")
    for c in TensorClass:
        row = (ledger.today_at_peak.get(c, 0), ledger.today_class_peak[c],
               ledger.pinned_class_peak_bytes[c])
        if any(row):
            print(f"| {c} | " + " | ".join(gib(v) for v in row) + " |")
    print(f"| **all** | **{gib(ledger.today_peak)}** | "
          f"**{gib(sum(ledger.today_class_peak.values()))}** (torch's cache keeps freed "
          f"blocks) | **{gib(ledger.pinned_peak_bytes)}** |")
    size = arena.pinned_bytes()
    print()
    print(f"arena: {gib(size.total_bytes)} = persistent {gib(size.persistent_bytes)} + the "
          f"step's {gib(size.transient_bytes)} (its live peak {gib(ledger.pinned_peak_bytes)})")


if __name__ == "__main__":
    main()

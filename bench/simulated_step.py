#!/usr/bin/env python3
"""The design point's step as the planner's replay simulates it (issue R, "Overlap").

Plans the design point (`tierlm plan --model-size 7b --hardware rtx4090 --host-memory 64GiB
--disk-budget 200GiB --batch-size 4 --seq-len 2048 --grad-accum-steps 8`, bf16 and fp8) and 13B
at 128 GiB of host memory (400 GiB of disk), and prints per case:

- the plan's placement (segments whose state is on the device / host / disk, how many keep
  their compute weights resident, the micro-batch order);
- the formula's step (`_times`: the sweep's max of the lanes plus the update stall) and its
  ratio to the formula's compute;
- the simulated step: the replay of the engine's operations on a timing device
  (tierlm.plan.replay, the second of two steps), its compute lower bound (the compute lane's
  busy time) and the ratio of the two;
- each lane's busy time in the simulated step (compute, H2D, D2H, disk, the update worker's
  CPU, the training thread's gradient adds) and the compute's time waiting for copies;
- for each copy lane, the share of its busy time that overlaps compute (the issue's target:
  at least 90%).

- whether the planner took speculative disk-tier updates (EngineOptions.speculative_updates:
  each disk-tier update issued at its gradient's final landing into a second set of files,
  kept where the clipping coefficient is 1), with the simulated step of the variant it did not
  take;
- an oracle: the same plan with 32 GiB more host RAM for the update read-ahead
  (ReadAhead.extra_bytes; a plan may not take it, the budget does not hold it): the update's
  master and slot reads start in the forward instead of queueing on the drive behind the
  backward's gradient writes. What host RAM, not the engine's ordering, leaves of each copy
  lane's busy time outside compute.

The issue's targets (after its item 3): bf16 at most 1.15x its compute bound, each copy lane
at least 90% under compute. It runs the planner only (about a minute per case on 2 cores).

    python bench/simulated_step.py

Results: docs/results/7b-design-point.md.
"""

from __future__ import annotations

import time
from dataclasses import replace

from tierlm.memory.hardware import resolve
from tierlm.models import preset_config
from tierlm.plan.evaluate import replay_plan, spare_disk_bytes
from tierlm.plan.search import plan
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.shapes import ModelShape, TrainShape

GiB = 2**30
ORACLE_RAM = 32 * GiB  # the oracle's host bytes beyond the plan's, all for the read-ahead

CASES = [  # (model, precision, host memory GiB, disk budget GiB)
    ("7b", "bf16", 64, 200), ("7b", "fp8", 64, 200),
    ("13b", "bf16", 128, 400), ("13b", "fp8", 128, 400),
]


def share(t: dict[str, float], key: str) -> str:
    busy = t[f"simulated_{key}"]
    return f"{t[f'simulated_{key}_overlap'] / busy:.0%}" if busy else "-"


def row(model: str, precision: str, host: int, disk: int) -> list[str]:
    shape = ModelShape.from_config(preset_config(model, max_seq_len=2048))
    train = TrainShape(batch_size=4, seq_len=2048, micro_batches=8, precision=precision)
    hw = resolve("rtx4090", host_memory_bytes=host * GiB, disk_budget_bytes=disk * GiB)
    t0 = time.perf_counter()
    p = plan(shape, train, hw, advise=False)
    took = time.perf_counter() - t0
    t = p.times_s
    counts = p.tier_counts()
    sim, bound = t["simulated_step"], t["simulated_compute"]
    return [
        f"{model} {precision} {host} GiB",
        f"{counts['device']}/{counts['host']}/{counts['disk']}; "
        f"{len(p.resident_names())} resident; {p.order}",
        f"{t['estimate']:.1f} s = {t['estimate'] / t['compute']:.2f}x",
        f"{sim:.1f} s", f"{bound:.1f} s", f"{sim / bound:.2f}x",
        " / ".join(f"{t[f'simulated_{k}']:.1f}" for k in ("h2d", "d2h", "disk", "cpu_update",
                                                         "cpu_adds")),
        f"{t['simulated_transfer_wait']:.1f} s",
        " / ".join(share(t, k) for k in ("h2d", "d2h", "disk")),
        f"{took:.0f} s",
        speculation(shape, train, p),
        oracle(shape, train, hw, p, bound),
    ]


def speculation(shape, train, p) -> str:
    """The planner's choice of speculative updates (with the disk its spare files take) and
    the simulated step of the variant it did not take."""
    t = p.times_s
    spare = sum(spare_disk_bytes(shape, train, p.placements).values()) / GiB
    if p.speculative:
        return f"on (+{spare:.1f} GiB disk; {t['simulated_step_plain']:.1f} s without)"
    if "simulated_step_speculative" in t:
        return f"off ({t['simulated_step_speculative']:.1f} s with, +{spare:.1f} GiB disk)"
    return "-"


def oracle(shape, train, hw, p, bound: float) -> str:
    """The same plan replayed with `ORACLE_RAM` more host bytes for the update read-ahead:
    the simulated step (x the compute bound) and each copy lane's share under compute."""
    extra = (0 if p.readahead is None else p.readahead.extra_bytes) + ORACLE_RAM
    r = replay_plan(shape, train, hw, replace(p, readahead=ReadAhead(extra_bytes=extra)))
    under = " / ".join(f"{r.overlap_s.get(lane, 0.0) / r.lane_busy_s[lane]:.0%}"
                       if r.lane_busy_s.get(lane) else "-" for lane in ("H2D", "D2H", "disk"))
    return f"{r.step_s:.1f} s = {r.step_s / bound:.2f}x ({under})"


def main() -> None:
    print("rtx4090 profile, 8 x 4 x 2048 tokens per step; the simulated step is the replay's "
          "second of two steps (tierlm.plan.replay)")
    print()
    head = ["case", "state device/host/disk; resident; order", "the search's estimate (x compute)",
            "simulated step", "compute bound (compute lane busy)", "ratio",
            "lanes busy s: H2D / D2H / disk / CPU update / CPU adds",
            "compute waiting for copies", "under compute: H2D / D2H / disk", "plan took",
            "speculative updates (the planner's choice)",
            "oracle: +32 GiB host RAM for the update read-ahead (x compute bound; under compute: "
            "H2D / D2H / disk)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case in CASES:
        print("| " + " | ".join(row(*case)) + " |", flush=True)


if __name__ == "__main__":
    main()

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
- an oracle: the same plan with each disk-tier update issued at its gradient's final landing
  instead of after the global norm (the clipping coefficient taken as 1), the step that exact
  global-norm clipping costs (where the planner took speculative updates, the plan's own).

The issue's targets (after its item 3): bf16 at most 1.15x its compute bound, each copy lane
at least 90% under compute. It runs the planner only (about a minute per case on 2 cores).

    python bench/simulated_step.py

Results: docs/results/7b-design-point.md.
"""

from __future__ import annotations

import time

from tierlm.memory.hardware import resolve
from tierlm.models import preset_config
from tierlm.plan.evaluate import spare_disk_bytes
from tierlm.plan.replay import ReplayConfig, simulate_step
from tierlm.plan.search import plan
from tierlm.runtime.shapes import ModelShape, TrainShape

GiB = 2**30

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
    """The same plan with each disk-tier update issued at its gradient's final landing (the
    clipping coefficient taken as 1; ReplayConfig.speculative_disk_updates): the step exact
    global-norm clipping costs, as the replay simulates it."""
    r = simulate_step(shape, train, p.placements, p.order, p.keep_resident_activations,
                      p.boundary_on_host,
                      ReplayConfig(hw=hw, speculative_disk_updates=True,
                                   held_gradients=p.held_gradients),
                      readahead=p.readahead, writeback=p.writeback)
    disk = r.lane_busy_s.get("disk", 0.0)
    under = r.overlap_s.get("disk", 0.0) / disk if disk else 0.0
    return f"{r.step_s:.1f} s = {r.step_s / bound:.2f}x (disk {under:.0%} under compute)"


def main() -> None:
    print("rtx4090 profile, 8 x 4 x 2048 tokens per step; the simulated step is the replay's "
          "second of two steps (tierlm.plan.replay)")
    print()
    head = ["case", "state device/host/disk; resident; order", "the search's estimate (x compute)",
            "simulated step", "compute bound (compute lane busy)", "ratio",
            "lanes busy s: H2D / D2H / disk / CPU update / CPU adds",
            "compute waiting for copies", "under compute: H2D / D2H / disk", "plan took",
            "speculative updates (the planner's choice)",
            "oracle: disk updates at their final landing (x compute bound)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case in CASES:
        print("| " + " | ".join(row(*case)) + " |", flush=True)


if __name__ == "__main__":
    main()

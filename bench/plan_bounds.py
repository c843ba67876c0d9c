#!/usr/bin/env python3
"""How far the design point's plan is from compute-bound, and what binds (issue J).

Replans the design point (`tierlm plan --model-size 7b --hardware rtx4090 --host-memory 64GiB
--disk-budget 200GiB --batch-size 4 --seq-len 2048 --grad-accum-steps 8`, fp8 and bf16, and 13B
with 128 GiB / 400 GiB) and prints, per case, the predicted step over its compute lower bound:

- `without the disk options`: the planner with neither disk-tier gradients held in host RAM nor
  the update's read-ahead (the same time model otherwise: the plan the engine could run before
  they existed).
- `write-back inside the update`: the planner with both options but the disk-tier update's
  master/slot write-back inside the update (session 28's engine: every forward waits for it).
- `as planned`: the planner as it is, with what it chose: the micro-batch order, how many
  disk-tier segments hold their gradient on the host, how much master and slot state the
  backward reads ahead, how many segments' write-backs may be pending behind the step.
- `free disk`: disk rates x 1000; what remains is compute, PCIe and the CPU update.
- `one disk`: the plan's disk seconds (sweep and update share the drive) over the compute: a
  step is never shorter than that.
- `update / window`: the update's seconds (CPU, and the disk work the forward waits for: reads
  not done ahead, compute copies, written-back state inside the update), the write-back that
  drains behind the step, against the window the update hides behind, the first micro-batch
  group's forward of the next step (every segment's forward waits for its update).
- bytes per link moved by the plan beside the least that plan could move: the refresh of every
  off-device segment's compute copy and the parked boundary inputs H2D; each gradient once
  (4 B per off-device parameter) and the parked inputs D2H; master and moments of the
  disk-tier segments read once, and written once with their compute copy.

    python bench/plan_bounds.py

Results: docs/results/7b-design-point.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tierlm.memory.hardware import resolve
from tierlm.memory.tiers import Tier
from tierlm.models import preset_config
from tierlm.plan import search as planner
from tierlm.plan.evaluate import parked_bytes
from tierlm.plan.result import Plan
from tierlm.plan.search import plan
from tierlm.runtime.shapes import ModelShape, TrainShape

GiB = 2**30

CASES = [  # (model, precision, host memory)
    ("7b", "fp8", 64), ("7b", "bf16", 64), ("7b", "fp8", 96),
    ("13b", "fp8", 128), ("13b", "bf16", 128),
]


@contextlib.contextmanager
def write_back_inside() -> Iterator[None]:
    original = planner.WRITEBACK_SEGMENTS
    planner.WRITEBACK_SEGMENTS = ()
    try:
        yield
    finally:
        planner.WRITEBACK_SEGMENTS = original


@contextlib.contextmanager
def without_disk_options() -> Iterator[None]:
    original = planner._disk_options
    planner._disk_options = lambda shape, train, hw, candidate, budgets, replays=None: candidate
    try:
        yield
    finally:
        planner._disk_options = original


def least_moved(p: Plan, shape: ModelShape, train: TrainShape) -> dict[str, int]:
    parked = parked_bytes(shape, train, p.order, p.boundary_on_host) * (
        1 if p.order == "layer-outer" else train.micro_batches)
    off = [s for s, pl in enumerate(p.placements) if pl.state_tier != Tier.DEVICE]
    disk = [s for s, pl in enumerate(p.placements) if pl.state_tier == Tier.DISK]

    def copy_bytes(s: int) -> int:
        return shape.wire_bytes(s, train.precision) or 4 * shape.numels[s]

    return {
        "h2d": sum(copy_bytes(s) for s in off) + parked,
        "d2h": 4 * sum(shape.numels[s] for s in off) + parked,
        "disk_read": sum(shape.update_state_bytes(s) for s in disk),
        "disk_write": sum(shape.update_state_bytes(s) + (shape.wire_bytes(s, train.precision)
                                                         or 0) for s in disk),
    }


def estimate(p: Plan) -> tuple[float, float]:
    """The search's closed-form step and its ratio to the compute (this bench's subject; the
    plan's prediction is the simulated step, bench/simulated_step.py)."""
    t = p.times_s
    step = t.get("estimate", t["step"])
    return step, step / t["compute"]


def row(model: str, precision: str, host: int) -> list[str]:
    shape = ModelShape.from_config(preset_config(model, max_seq_len=2048))
    train = TrainShape(batch_size=4, seq_len=2048, micro_batches=8, precision=precision)
    disk = 400 if model == "13b" else 200
    hw = resolve("rtx4090", host_memory_bytes=host * GiB, disk_budget_bytes=disk * GiB)
    fast = hw.with_overrides(disk_read_Bps=hw.disk_read_Bps * 1000,
                             disk_write_Bps=hw.disk_write_Bps * 1000)
    with without_disk_options():
        before = plan(shape, train, hw)
    with write_back_inside():
        inside = plan(shape, train, hw)
    now = plan(shape, train, hw)
    free = plan(shape, train, fast)
    t = now.times_s
    disk_segs = [pl for pl in now.placements if pl.state_tier == Tier.DISK]
    ahead = sum(shape.update_state_bytes(s) for s in now.readahead_segments)
    least = least_moved(now, shape, train)
    return [
        f"{model} {precision} {host} GiB", f"{t['compute']:.1f}",
        f"{estimate(before)[1]:.2f}",
        "{:.1f} s = {:.2f}".format(*estimate(inside)),
        "{:.1f} s = {:.2f}".format(*estimate(now)),
        f"{now.order}; {sum(pl.host_grad for pl in disk_segs)}/{len(disk_segs)}; "
        f"{ahead / GiB:.1f} GiB; "
        f"{'inside' if now.writeback is None else now.writeback.segments}",
        f"{estimate(free)[1]:.2f}",
        f"{t['disk']:.1f} s = {t['disk'] / t['compute']:.2f}",
        f"{t['update_ready']:.1f} s ({t['cpu_update']:.1f} + "
        f"{t['update_ready'] - t['cpu_update']:.1f}) + {t['writeback']:.1f} behind / "
        f"{t['update_window']:.1f} s (stall {t['update_stall']:.1f})",
        " / ".join(f"{now.moved_bytes.get(k, 0) / GiB:.0f} ({least[k] / GiB:.0f})"
                   for k in ("h2d", "d2h", "disk_read", "disk_write")),
    ]


def main() -> None:
    print("rtx4090 profile (planner constants unchanged), 8 x 4 x 2048 tokens per step; ratios "
          "are predicted step / compute lower bound")
    print()
    head = ["case", "compute s", "without the disk options", "write-back inside the update",
            "as planned",
            "order; disk segments with host gradients; read ahead; write-backs pending",
            "free disk", "one disk", "update (CPU + disk) + write-back / window",
            "GiB moved H2D / D2H / disk read / disk write (least for that plan)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case in CASES:
        print("| " + " | ".join(row(*case)) + " |", flush=True)


if __name__ == "__main__":
    main()

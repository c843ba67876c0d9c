#!/usr/bin/env python3
"""Why the design point's plan is not compute-bound: the planner under oracles (issue J).

The plan for 7B on a 24 GB card with 64 GiB of RAM predicts a step about 2x its compute lower
bound. This bench replans the same commands with one constraint of the time model lifted at a
time, so the table says which constraint costs what:

- `as planned`: the planner as it is.
- `free disk`: disk reads and writes cost nothing (disk rates x 1000). What remains is compute,
  PCIe and the CPU update.
- `update overlaps whole step`: the optimizer update of step i may run behind all of step i+1
  (its forward and backward), not only behind its forward; one disk still serves both, so the
  step is at least the sweep's and the update's disk time together. Exact clipped AdamW cannot
  do this: step i+1's forward of segment s needs segment s's updated weights, and the update
  cannot start before step i's backward has produced the global gradient norm. This row is
  the bound for any schedule that keeps exact clipping but moves the disk traffic freely
  through the step.
- `+ gradients off disk`: as the previous row, and disk-tier gradients never touch the disk
  (they would wait in the host RAM the boundary activations free during the backward).
- `disk floor`: the fewest disk seconds any exact plan needs with this RAM: master and both
  moments of every disk-resident segment read once and written once per step. A step is at
  least max(compute, disk floor).

    python bench/plan_bounds.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tierlm.memory import planner
from tierlm.memory.hardware import resolve
from tierlm.memory.planner import ModelShape, TrainShape, plan
from tierlm.memory.tiers import Link, Tier
from tierlm.models import preset_config

GiB = 2**30

CASES = [  # (model, precision, host memory)
    ("7b", "fp8", 64), ("7b", "bf16", 64), ("7b", "fp8", 96), ("7b", "fp8", 128),
    ("13b", "fp8", 64), ("13b", "fp8", 128), ("13b", "bf16", 128),
]


@contextlib.contextmanager
def whole_step_update(grads_off_disk: bool) -> Iterator[None]:
    original = planner._times

    def times(shape, train, hw, placements, keep, moved):
        t = dict(original(shape, train, hw, placements, keep, moved))
        disk_params = sum(n for n, p in zip(shape.numels, placements, strict=True)
                          if p.state_tier == Tier.DISK)
        if grads_off_disk:
            # the update's gradient read and every sweep gradient write disappear
            grad_read = 4 * disk_params / hw.disk_read_Bps
            sweep_writes = moved.get(Link.DISK_WRITE.value, 0) - 12 * disk_params
            t["update_disk"] -= grad_read
            t["update"] -= grad_read
            t["sweep_disk"] -= max(0, sweep_writes) / hw.disk_write_Bps
            t["disk"] = t["sweep_disk"] + t["update_disk"]
        sweep = (t["compute"] + t["h2d"] + t["d2h"] + t["sweep_disk"] if hw.device_is_cpu
                 else max(t["compute"], t["h2d"], t["d2h"], t["sweep_disk"]))
        # hidden behind the whole step, but one disk serves the sweep and the update
        step = max(sweep, t["update"], t["sweep_disk"] + t["update_disk"])
        t["update_stall"] = step - sweep
        t["step"] = step
        return t

    planner._times = times
    try:
        yield
    finally:
        planner._times = original


def row(model: str, precision: str, host: int) -> list[str]:
    shape = ModelShape.from_config(preset_config(model, max_seq_len=2048))
    train = TrainShape(batch_size=4, seq_len=2048, micro_batches=8, precision=precision)
    disk = 400 if model == "13b" else 200
    hw = resolve("rtx4090", host_memory_bytes=host * GiB, disk_budget_bytes=disk * GiB)
    fast = hw.with_overrides(disk_read_Bps=hw.disk_read_Bps * 1000,
                             disk_write_Bps=hw.disk_write_Bps * 1000)
    base = plan(shape, train, hw)
    cells = [f"{model} {precision} {host} GiB", f"{base.times_s['compute']:.1f}",
             f"{base.step_s:.1f}", f"{base.step_over_bound:.2f}"]
    free = plan(shape, train, fast)
    cells.append(f"{free.step_over_bound:.2f}")
    with whole_step_update(grads_off_disk=False):
        cells.append(f"{plan(shape, train, hw).step_over_bound:.2f}")
    with whole_step_update(grads_off_disk=True):
        cells.append(f"{plan(shape, train, hw).step_over_bound:.2f}")
    disk_state = sum(base.disk_by_class.get(c, 0) for c in ("master", "optim_state"))
    floor = disk_state / hw.disk_read_Bps + disk_state / hw.disk_write_Bps
    cells.append(f"{gib(disk_state)} / {floor:.1f} s = {floor / base.times_s['compute']:.2f}x")
    return cells


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def main() -> None:
    print("rtx4090 profile (planner constants unchanged), 8 x 4 x 2048 tokens per step; "
          "columns after 'as planned' are predicted step / compute lower bound")
    print()
    head = ["case", "compute s", "planned step s", "as planned", "free disk",
            "update overlaps whole step", "+ gradients off disk",
            "disk state (master+moments) / disk floor"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case in CASES:
        print("| " + " | ".join(row(*case)) + " |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The smallest device + host budgets the planner accepts for the shapes of bench/scale.py, as a
fraction of the training state (16 B/param).

For each device budget on a grid above the smallest one the planner accepts at all, the smallest
host budget is found by bisection; the table shows the pair with the smallest sum, and the
smallest device and host budgets alone. The planner only: nothing is allocated.

    python bench/min_budgets.py [--shape qwen2.5-1.5b] [--seq-len 128] [--batch-size 1]

Results: docs/results/scale.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import SHAPES  # noqa: E402

GiB = 2**30
STEP = GiB // 64  # the bisection's resolution


def smallest(fits, lo: int, hi: int) -> int | None:
    """The smallest budget in [lo, hi] (to STEP) for which `fits` holds, assuming it holds
    from there on; None if it does not hold at hi."""
    if not fits(hi):
        return None
    while hi - lo > STEP:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grid", type=int, default=12, help="device budgets tried per shape")
    args = p.parse_args()

    from transformers import Qwen2Config

    from tierlm.memory.hardware import resolve
    from tierlm.plan.search import plan
    from tierlm.runtime.shapes import ModelShape, TrainShape

    hw = resolve("cpu", disk_budget_bytes=1 << 50)  # as bench/scale.py runs: fp32, CPU
    train = TrainShape(args.batch_size, args.seq_len, 1, "fp32")
    print("| shape | state GiB | min device GiB (host free) | min host GiB (device free) "
          "| best device + host GiB | fraction of state |")
    print("|---|---:|---:|---:|---|---:|")
    for name in args.shape or sorted(SHAPES):
        shape = ModelShape.from_config(Qwen2Config(**SHAPES[name]))
        state = 16 * shape.n_params
        big = 4 * state

        def fits(device: int, host: int, shape=shape) -> bool:
            return plan(shape, train, hw, device_budget=device, host_budget=host,
                        advise=False).fits

        d_min = smallest(lambda d, big=big: fits(d, big), 0, big)
        h_min = smallest(lambda h, big=big: fits(big, h), 0, big)
        best = None
        for k in range(args.grid):
            d = d_min + k * GiB // 4
            h = smallest(lambda h, d=d: fits(d, h), 0, big)
            if h is not None and (best is None or d + h < sum(best)):
                best = (d, h)
        d, h = best
        print(f"| {name} | {state / GiB:.1f} | {d_min / GiB:.2f} | {h_min / GiB:.2f} | "
              f"{d / GiB:.2f} + {h / GiB:.2f} = {(d + h) / GiB:.2f} | "
              f"{(d + h) / state:.3f} |", flush=True)


if __name__ == "__main__":
    main()

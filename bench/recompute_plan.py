#!/usr/bin/env python3
"""What recomputing streamed blocks costs the design point, and what binds it (issue U, "Plan").

For the 7B design point (`tierlm plan --model-size 7b --hardware rtx4090 --host-memory 64GiB
--disk-budget 200GiB --batch-size 4 --seq-len 2048 --grad-accum-steps 8`, bf16 and fp8) and 13B
at 128 GiB of host memory, the planner's plan is simulated (tierlm.plan.replay, the engine's
operations on a timing device) with these activation choices on the same placement:

- `recompute`: every block that does not keep on the planner's rule recomputes its forward
  (the plan before the keep / offload / recompute choice);
- `planner's choice`: the plan as `tierlm plan` makes it, with its keep / offload / recompute
  choice per streamed block (tierlm.plan.offload: offload where host RAM holds the saved
  tensors and the simulated step is faster);
- `offload all recomputing (oracle, host RAM ignored)`: every block the plan recomputes holds
  its saved tensors in host RAM instead, boundary inputs on the device (an offloaded graph holds
  its input): whether the links have the slack to carry the copies, whatever the memory;
- `keep where room`: `--grad-checkpointing none`'s engine rule (tierlm.activations.spec
  `keep_streamed`) applied with the planner's byte model: streamed blocks keep their graph,
  last first, while the plan's device peak plus the saved tensors stays within the device
  budget;
- `keep all` (an oracle that ignores memory): no block recomputes; the device bytes it would
  need are printed beside it.

Per row: the simulated step, tokens/s, the ratio of tokens/s to the 6N bound (the precision's
peak matmul rate over 6 FLOPs per parameter and token: the issue's target is 0.6 for bf16
7B, 2,450 tokens/s on a 4090), and the device bytes of saved activations. The last column is
the time model's own ceiling: with no recompute and no stall, compute alone (6N plus attention
and the head at the planner's MATMUL_EFFICIENCY of the peak) caps tokens/s at that share of
the 6N bound.

    python bench/recompute_plan.py

Results: docs/results/7b-design-point.md.
"""

from __future__ import annotations

import time

from tierlm.memory.hardware import resolve
from tierlm.memory.placement import keeps_graph
from tierlm.models import preset_config
from tierlm.plan.evaluate import evaluate, simulated_times
from tierlm.plan.search import plan
from tierlm.plan.timing import MATMUL_EFFICIENCY
from tierlm.runtime.byte_replay import activation_workspace_bytes
from tierlm.runtime.shapes import ModelShape, TrainShape

GiB = 2**30

CASES = [  # (model, precision, host memory GiB, disk budget GiB)
    ("7b", "bf16", 64, 200), ("7b", "fp8", 64, 200), ("13b", "bf16", 128, 400),
]


def keep_where_room(shape, train, p) -> tuple[bool, ...]:
    """Streamed blocks keep their graph, last first, while the plan's device bytes (its ledger
    peak and the workspace the keep flags imply) fit the device budget."""
    keep = keeps_graph(p.placements, p.keep_resident_activations)
    last = len(keep) - 1
    for s in reversed(range(1, last)):
        if keep[s]:
            continue
        trial = keep[:s] + [True] + keep[s + 1:]
        need = p.device_peak_bytes + activation_workspace_bytes(shape, train, trial[:last],
                                                                p.order)
        if need <= p.budgets["device"]:
            keep = trial
    return tuple(keep)


def simulate(shape, train, hw, p, keep: tuple[bool, ...], offload: tuple[bool, ...] = (),
             boundary_host: bool | None = None):
    boundary = p.boundary_on_host if boundary_host is None else boundary_host
    q = evaluate(shape, train, hw, p.placements, p.order, keep, p.budgets,
                 boundary, readahead=p.readahead, writeback=p.writeback, offload=offload)
    step = simulated_times(shape, train, hw, q)["simulated_step"]
    last = len(keep) - 1
    acts = q.workspace_bytes
    off = sum(offload[1:last]) if offload else 0
    return step, acts, sum(not k for k in keep[1:last]) - off, off, q.host_peak_bytes


def rows(model: str, precision: str, host: int, disk: int) -> list[list[str]]:
    shape = ModelShape.from_config(preset_config(model, max_seq_len=2048))
    train = TrainShape(batch_size=4, seq_len=2048, micro_batches=8, precision=precision)
    hw = resolve("rtx4090", host_memory_bytes=host * GiB, disk_budget_bytes=disk * GiB)
    t0 = time.perf_counter()
    p = plan(shape, train, hw, advise=False)
    peak = hw.fp8_matmul_flops if precision == "fp8" and hw.fp8_matmul_flops else (
        hw.matmul_flops)
    bound_tps = peak / (6 * shape.n_params)  # tokens/s at 6N FLOPs per token, at peak
    tokens = train.tokens_per_step
    blocks = len(p.placements) - 2
    keep_all = tuple([True] * len(p.placements))
    # the time model's ceiling: FLOPs per token without recompute (the formula's compute)
    no_recompute = evaluate(shape, train, hw, p.placements, p.order, keep_all, p.budgets,
                            p.boundary_on_host, readahead=p.readahead, writeback=p.writeback)
    ceiling = tokens / no_recompute.times_s["compute"] / bound_tps
    out = []
    planned = tuple(keeps_graph(p.placements, p.keep_resident_activations))
    recomputing = tuple(not k for k in planned[:-1]) + (False,)
    choices = (("recompute (no offload)", planned, (), None),
               ("planner's choice", planned, p.offload_graphs, None),
               ("keep where room", keep_where_room(shape, train, p), (), None),
               ("offload all recomputing (oracle, host RAM ignored)", planned,
                tuple(r and 0 < s < blocks + 1 for s, r in enumerate(recomputing)), False),
               ("keep all (oracle, memory ignored)", keep_all, (), None))
    for name, keep, offload, boundary in choices:
        step, acts, recomputed, offloaded, host_peak = simulate(
            shape, train, hw, p, tuple(keep), offload, boundary)
        tps = tokens / step
        out.append([
            f"{model} {precision} {host} GiB", f"{p.order}; {len(p.resident_names())} resident",
            name, f"{recomputed}/{offloaded}/{blocks}", f"{step:.1f} s", f"{tps:,.0f}",
            f"{tps / bound_tps:.2f}", f"{acts / GiB:.1f} GiB of {p.budgets['device'] / GiB:.1f}"
            f" (state {p.device_peak_bytes / GiB:.1f})",
            f"{host_peak / GiB:.1f} GiB of {p.budgets['host'] / GiB:.1f}",
            f"{ceiling:.2f}",
        ])
    out[-1][-1] += f" ({time.perf_counter() - t0:.0f} s)"
    per_mb = shape.saved_bytes_per_token(precision) * train.batch_size * train.seq_len * blocks
    NOTES.append(f"{model} {precision}: every block's saved tensors, one micro-batch in flight "
                 f"(microbatch-outer): {per_mb / GiB:.1f} GiB; all {train.micro_batches} "
                 f"(layer-outer): {per_mb * train.micro_batches / GiB:.1f} GiB; the device "
                 f"budget {p.budgets['device'] / GiB:.1f} GiB, host {p.budgets['host'] / GiB:.1f}"
                 " GiB")
    return out


NOTES: list[str] = []


def main() -> None:
    print(f"rtx4090 profile, 8 x 4 x 2048 tokens per step; MATMUL_EFFICIENCY "
          f"{MATMUL_EFFICIENCY}; simulated step: the replay's second of two steps")
    print()
    head = ["case", "plan", "activations", "blocks recomputing/offloaded/all",
            "simulated step", "tokens/s", "x 6N bound",
            "device activations (budget; plan's state)", "host peak (budget)",
            "time model's ceiling (x 6N)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case in CASES:
        for r in rows(*case):
            print("| " + " | ".join(r) + " |", flush=True)
    print()
    for line in NOTES:
        print(f"- {line}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tierlm's plan for a model on a GPU next to DeepSpeed's documented ZeRO memory estimates.

DeepSpeed's estimators (deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs
and deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, 1 node, 1 GPU,
additional_buffer_factor=1.5) count model states only, as these rows do; activations come on
top for both systems. Formulas, per parameter count N and largest layer L (params):

    ZeRO-2 + offload_optimizer=cpu:             GPU 2N            CPU 16N x 1.5
    ZeRO-3 + offload_optimizer=cpu:             GPU 4L + 2N       CPU 16N x 1.5
    ZeRO-3 + offload_optimizer/param=cpu:       GPU 4L            CPU 18N x 1.5
    ZeRO-Infinity (offload to nvme):            GPU 4L            NVMe 18N, CPU pinned buffers

    python bench/planner_vs_deepspeed.py --model-size 7b --hardware rtx4090 --host-memory 64

Results: docs/planner_vs_deepspeed.md (a comparison of formulas, no measurement).
"""

from __future__ import annotations

import argparse

from tierlm.memory.hardware import PROFILES, GiB
from tierlm.models import build_model, preset_config
from tierlm.plan.search import plan
from tierlm.runtime.shapes import ModelShape, TrainShape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-size", default="7b")
    p.add_argument("--hardware", default="rtx4090")
    p.add_argument("--host-memory", type=float, default=64, help="GiB")
    p.add_argument("--disk", type=float, default=200, help="GiB")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--precision", default="bf16")
    a = p.parse_args()

    cfg = preset_config(a.model_size, max_seq_len=a.seq_len)
    model = build_model(cfg, device="meta")
    n = sum(x.numel() for x in model.parameters())
    largest = max(sum(x.numel() for x in m.parameters(recurse=False)) for m in model.modules())
    hw = PROFILES[a.hardware].with_overrides(
        host_memory_bytes=int(a.host_memory * GiB), disk_budget_bytes=int(a.disk * GiB)
    )
    shape = ModelShape.from_config(cfg)
    pl = plan(shape, TrainShape(a.batch_size, a.seq_len, a.accum, a.precision), hw)
    gpu_cap, host_cap = hw.gpu_memory_bytes / GiB, a.host_memory

    def row(name, gpu, cpu, nvme=0.0, note=""):
        fits = "yes" if gpu <= gpu_cap and cpu <= host_cap and nvme <= a.disk else "no"
        print(f"| {name} | {gpu:.1f} | {cpu:.1f} | {nvme:.1f} | {fits} | {note} |")

    print(f"{a.model_size}: N = {n:,} params, largest layer L = {largest:,}; {hw.name} "
          f"({gpu_cap:.1f} GiB), {host_cap:.0f} GiB RAM, {a.disk:.0f} GiB disk; model states "
          "only (GiB)")
    print()
    print("| system / setting | GPU | CPU RAM | NVMe | fits | note |")
    print("|---|---|---|---|---|---|")
    row("ZeRO-2 + optimizer offload to CPU", 2 * n / GiB, 16 * n * 1.5 / GiB)
    row("ZeRO-3 + optimizer offload to CPU", (4 * largest + 2 * n) / GiB, 16 * n * 1.5 / GiB)
    row("ZeRO-3 + optimizer and param offload to CPU", 4 * largest / GiB, 18 * n * 1.5 / GiB)
    row("ZeRO-Infinity (optimizer and params on NVMe)", 4 * largest / GiB,
        5 * 1e8 * 2 / GiB, 18 * n / GiB,
        "CPU: at least the pinned parameter swap buffers (buffer_count 5 x buffer_size 1e8 "
        "fp16 by default) plus optimizer swap buffers set by config; every byte of state "
        "crosses NVMe every step")
    row(f"tierlm plan ({pl.order}, {pl.tier_counts()['host']} segments' state in RAM, "
        f"{pl.tier_counts()['disk']} on disk)",
        pl.device_peak_bytes / GiB, pl.host_peak_bytes / GiB, pl.disk_bytes / GiB,
        f"GPU total with activation workspace: {pl.device_total_bytes / GiB:.1f} GiB; "
        f"predicted {pl.tokens_per_s:,.0f} tokens/s, bottleneck {pl.bottleneck}")


if __name__ == "__main__":
    main()

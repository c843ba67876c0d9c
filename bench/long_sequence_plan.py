#!/usr/bin/env python3
"""What fits for one long sequence: the planner's plan per context-parallel degree and precision.

Each row plans one rank of a run whose rows of --seq-len tokens are shared by N ranks (N = 1: one
device holds the whole row), as `tierlm plan --context-parallel N` does: the device bytes split
into the ledger's model state and boundary activations, the activation workspace outside it (one
block's saved tensors per token, measured on fake tensors under the run's precision), where the
boundary activations wait, the ring's K/V bytes per rank per step and the time they take at the
profile's GPU-to-GPU rate against the attention they hide behind (the sweep's `net` lane), and
the predicted step with its bottleneck. The N ranks of the group also all-reduce their gradients
(dense fp32, `--nproc N`): the bytes each sends, the seconds they take and the part the step
waits for (all but the embedding's hide behind the backward where the link is free) join the same
lane. No training, no memory: seconds.

    PYTHONPATH=src python bench/long_sequence_plan.py --model-size 7b --hardware rtx4090 \\
        --host-memory 64 --disk 200 --seq-len 32768

The rows with fp8 and N > 1 are the planner's alone: training refuses --context-parallel with
--precision fp8 so far.

Results: docs/results/long-context.md.
"""

from __future__ import annotations

import argparse

from tierlm.memory.hardware import PROFILES, GiB
from tierlm.memory.placement import gib
from tierlm.models import preset_config
from tierlm.plan.result import usable_budgets
from tierlm.plan.search import plan
from tierlm.plan.timing import grad_sync_bytes, ring_kv_bytes
from tierlm.runtime.shapes import ModelShape, TrainShape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-size", default="7b")
    p.add_argument("--hardware", default="rtx4090")
    p.add_argument("--host-memory", type=float, default=64, help="GiB per rank")
    p.add_argument("--disk", type=float, default=200, help="GiB per rank")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--precisions", default="bf16,fp8")
    p.add_argument("--interconnect", type=float, default=None,
                   help="GPU-to-GPU GB/s per direction (default: the profile's)")
    a = p.parse_args()

    hw = PROFILES[a.hardware].with_overrides(
        host_memory_bytes=int(a.host_memory * GiB), disk_budget_bytes=int(a.disk * GiB),
        interconnect_Bps=None if a.interconnect is None else a.interconnect * 1e9)
    shape = ModelShape.from_config(preset_config(a.model_size, max_seq_len=a.seq_len))
    usable = usable_budgets(hw)["device"]
    print(f"{a.model_size}, {a.batch_size} x {a.seq_len} tokens per row, {hw.name}, host "
          f"{a.host_memory:g} GiB and disk {a.disk:g} GiB per rank; device usable {gib(usable)}; "
          f"GPU-to-GPU {hw.net_Bps / 1e9:.1f} GB/s per direction")
    for precision in a.precisions.split(","):
        print(f"  {precision}: one block saves {shape.saved_bytes_per_token(precision) / 1024:.1f}"
              " KiB per token")
    print("| CP | precision | tokens/rank | device state+boundaries | activation workspace "
          "| device total | boundaries | activations | ring K/V per step | net s | attention s "
          "| grad all-reduce per step | all-reduce s | waited s | net lane s "
          "| compute s | step s | bottleneck | row tokens/s | fits |")
    print("|---" * 20 + "|")
    for precision in a.precisions.split(","):
        for cp in (int(c) for c in a.cp.split(",")):
            train = TrainShape(a.batch_size, a.seq_len // cp, 1, precision, context_parallel=cp,
                               nproc=cp)
            pl = plan(shape, train, hw)
            fits = "yes" if pl.fits else "no: " + "; ".join(pl.problems)
            acts = "keep resident graphs" if pl.keep_resident_activations else "recompute all"
            kv = ring_kv_bytes(shape, train, pl.placements, pl.keep_resident_activations)
            t = pl.times_s
            # every rank of the group works on the same rows: the group's rate is N x a rank's
            print(f"| {cp} | {precision} | {train.seq_len} | {gib(pl.device_peak_bytes)} | "
                  f"{gib(pl.workspace_bytes)} | {gib(pl.device_total_bytes)} | "
                  f"{'host' if pl.boundary_on_host else 'device'} | {acts} | {gib(kv)} | "
                  f"{t['net']:.1f} | {t['attention']:.1f} | "
                  f"{gib(grad_sync_bytes(shape, train))} | {t['grad_sync']:.2f} | "
                  f"{t['grad_sync_exposed']:.2f} | {t['net_lane']:.1f} | {t['compute']:.1f} | "
                  f"{pl.step_s:.1f} | {pl.bottleneck} | {cp * pl.tokens_per_s:,.0f} | {fits} |")


if __name__ == "__main__":
    main()

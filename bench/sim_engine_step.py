#!/usr/bin/env python3
"""The tiered runtime's step on a simulated GPU (`--device sim:PROFILE`), per placement.

The real engine runs on this machine's CPU (so every number is exact) while a `SimDevice`
keeps the GPU's ordering in virtual time: this bench reports, per placement, the simulated
steady-state step, its compute lower bound (the compute lane's busy time), their ratio, each
lane's busy time, and the share of each copy lane's busy time that ran under compute. Usage:

    python bench/sim_engine_step.py --model-size small --batch-size 4 --seq-len 512 \
        --micro-batches 4 --hardware rtx4090

The first step fills the stream cache and runs nothing of a previous update: the table is the
median of the later steps.

Results: docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from tierlm.config import OptimConfig
from tierlm.memory.device import SimDevice
from tierlm.memory.hardware import PROFILES
from tierlm.memory.simulator import COMPUTE, Op
from tierlm.models.presets import build_model, preset_config
from tierlm.runtime import EngineOptions, build_engine
from tierlm.train.prepare import compute_autocast


def overlap_share(ops: list[Op], lane: str) -> float | None:
    """Share of `lane`'s busy time during which the compute lane was busy too."""
    busy = sorted((o.start_s, o.end_s) for o in ops if o.lane == COMPUTE)
    total = covered = 0.0
    for o in ops:
        if o.lane != lane:
            continue
        total += o.end_s - o.start_s
        for a, b in busy:
            covered += max(0.0, min(b, o.end_s) - max(a, o.start_s))
    return covered / total if total else None


def run(args, policy: str, order: str, precision: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(preset_config(args.model_size, vocab_size=args.vocab_size))
    dev = SimDevice(PROFILES[args.hardware], precision)
    with tempfile.TemporaryDirectory() as tmp:
        opts = EngineOptions(policy=policy, microbatch_order=order, offload_dir=tmp,
                             batch_size=args.batch_size, seq_len=args.seq_len,
                             micro_batches=args.micro_batches,
                             autocast=compute_autocast(precision, torch.device("cpu")))
        eng = build_engine(model, OptimConfig(lr=1e-4), opts, device=dev)
        g = torch.Generator().manual_seed(1)
        recs, shares = [], []
        for _ in range(args.steps):
            batches = [torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1),
                                     generator=g) for _ in range(args.micro_batches)]
            recs.append(eng.step(batches, 1e-4))
            shares.append({lane: overlap_share(dev.step_ops, lane) for lane in ("H2D", "D2H")})
        eng.close()
    later = recs[1:] or recs
    out = {k: statistics.median(r[k] for r in later) for k in later[0] if k.startswith("sim_")}
    for lane in ("H2D", "D2H"):
        vals = [s[lane] for s in shares[1:] or shares if s[lane] is not None]
        out[f"overlap_{lane}"] = statistics.median(vals) if vals else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", default="small")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hardware", default="rtx4090", choices=sorted(PROFILES))
    ap.add_argument("--placements", default="host,disk")
    ap.add_argument("--orders", default="microbatch-outer,layer-outer")
    ap.add_argument("--precisions", default="bf16")
    args = ap.parse_args()
    print(f"# {args.model_size}, {args.batch_size} x {args.seq_len} tokens x "
          f"{args.micro_batches} micro-batches, sim:{args.hardware}; ms of virtual time")
    print("| placement | order | precision | step | compute | step/compute | H2D | D2H | disk "
          "| CPU update | CPU adds | compute waits | H2D under compute | D2H under compute |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for policy in args.placements.split(","):
        for order in args.orders.split(","):
            for precision in args.precisions.split(","):
                r = run(args, policy, order, precision)
                ms = {k: 1e3 * v for k, v in r.items() if k.startswith("sim_")}
                print(f"| {policy} | {order} | {precision} | {ms['sim_step_s']:.2f} | "
                      f"{ms['sim_compute_s']:.2f} | "
                      f"{r['sim_step_s'] / r['sim_compute_s']:.2f}x | {ms['sim_h2d_s']:.2f} | "
                      f"{ms['sim_d2h_s']:.2f} | {ms['sim_disk_s']:.2f} | "
                      f"{ms['sim_cpu_update_s']:.2f} | {ms['sim_cpu_s']:.2f} | "
                      f"{ms['sim_transfer_wait_s']:.2f} | {r['overlap_H2D']:.0%} | "
                      f"{r['overlap_D2H']:.0%} |", flush=True)


if __name__ == "__main__":
    main()

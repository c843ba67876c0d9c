#!/usr/bin/env python3
"""Parity on real text: the `small` preset trained on the default corpus (Shakespeare) for the
same steps, batches and seed in fp32, bf16 and fp8 (dynamic scaling), then the held-out
perplexity of each and its gap to fp32.

    python bench/precision_parity.py --steps 600

Targets (issue D): bf16 within 1% of fp32, fp8 within 1.5% (the goal is 1%). Every run sees the
same batches in the same order (same seed, same sampler); only the precision differs.

Results: none recorded yet; the first run starts docs/results/precision.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from tierlm.config import from_dict
from tierlm.train import Trainer

TARGET_GAP = {"fp32": None, "bf16": 0.01, "fp8": 0.015}


def run(args: argparse.Namespace, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = from_dict({
            "model": {"size": args.model_size},
            "data": {"seq_len": args.seq_len},
            "optim": {"lr": args.lr, "warmup_steps": args.warmup},
            "train": {"max_steps": args.steps, "batch_size": args.batch_size, "eval_every": 0,
                      "eval_batches": args.eval_batches, "sample_tokens": 0},
            "precision": {"mode": mode, "fp8_scaling": args.fp8_scaling}
            if mode == "fp8" else {"mode": mode},
            "monitor": {"log_every": max(1, args.steps // 10)},
            "run": {"out": out, "seed": args.seed, "device": args.device},
        })
        t0 = time.perf_counter()
        trainer = Trainer(cfg, log=lambda _msg: None)
        result = trainer.train()
        wall_s = time.perf_counter() - t0
        switched = list(getattr(trainer.fp8, "switched", []))
        tail = result.losses[-max(1, args.steps // 10):]
        return {
            "ppl0": result.eval_ppl[0],
            "ppl": result.eval_ppl[args.steps],
            "train_loss": statistics.fmean(tail),
            "wall_s": wall_s,
            "params": trainer.n_params,
            "switched": switched,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="small")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="fp32,bf16,fp8",
                   help="comma-separated precisions; fp32 is required: every gap is to it")
    p.add_argument("--fp8-scaling", default="dynamic")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads; 0 keeps torch's default (1 is faster on a machine "
                   "whose cores are oversubscribed)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    if "fp32" not in modes:
        p.error(f"--modes {args.modes}: add fp32, the baseline every gap is measured against")
    unknown = [m for m in modes if m not in TARGET_GAP]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(TARGET_GAP)}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"model {args.model_size}, {args.steps} steps of {args.batch_size} x {args.seq_len} "
          f"tokens, lr {args.lr}, seed {args.seed}; held-out: {args.eval_batches} batches of "
          f"{args.batch_size} x {args.seq_len} tokens; fp8 scaling {args.fp8_scaling}")
    rows = []
    for mode in modes:
        r = run(args, mode)
        rows.append((mode, r))
        print(f"  {mode}: held-out ppl {r['ppl']:.3f} ({r['wall_s']:.0f} s)", file=sys.stderr,
              flush=True)
    base = dict(rows)["fp32"]["ppl"]
    print()
    print("| precision | steps | train loss (last 10%) | held-out ppl (step 0 -> end) "
          "| vs fp32 | target | wall time (s) |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows:
        gap = r["ppl"] / base - 1
        target = TARGET_GAP.get(mode)
        # the target bounds a loss of quality; a gap below -target (better than fp32 by more
        # than the target) is met but says the run is too short to resolve the target
        verdict = "-" if target is None else (
            f"<= {target:.1%}: {'met' if gap <= target else 'MISSED'}"
            + (" (lower than fp32 beyond the target: noise at this length)"
               if gap < -target else ""))
        note = f" (switched to bf16: {', '.join(r['switched'])})" if r["switched"] else ""
        print(f"| {mode}{note} | {args.steps} | {r['train_loss']:.4f} | {r['ppl0']:.1f} -> "
              f"{r['ppl']:.3f} | {gap:+.2%} | {verdict} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()

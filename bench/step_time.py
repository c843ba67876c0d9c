#!/usr/bin/env python3
"""Baseline: tokens/s and peak RSS of the reference trainer (whole model on one device).

Later benchmarks divide by these numbers. Usage:

    python bench/step_time.py --model-size small --batch-size 8 --seq-len 256 --steps 10

Warm-up steps are excluded from the timing; the table reports the median step.

Results: none recorded yet; a run goes in docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

import torch

from tierlm.config import from_dict
from tierlm.train import Trainer


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def measure(args: argparse.Namespace, precision: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = from_dict(
            {
                "model": {"size": args.model_size},
                "data": {"seq_len": args.seq_len, "vocab_size": args.vocab_size},
                "train": {
                    "max_steps": args.warmup + args.steps,
                    "batch_size": args.batch_size,
                    "grad_accum_steps": args.grad_accum_steps,
                    "eval_batches": 1,
                    "eval_every": 0,
                },
                "precision": {"mode": precision},
                "run": {"out": out, "device": args.device},
            }
        )
        trainer = Trainer(cfg, log=lambda _msg: None)
        gc.collect()
        reset_peak_rss()
        times = []
        for i in range(args.warmup + args.steps):
            rec = trainer.train_step()
            if i >= args.warmup:
                times.append(rec["step_time_s"])
        step_s = statistics.median(times)
        return {
            "params": trainer.n_params,
            "step_s": step_s,
            "tokens_per_s": trainer.tokens_per_step / step_s,
            "peak_rss_bytes": peak_rss_bytes(),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="fp32", help="comma-separated: fp32,bf16")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(
        f"model {args.model_size}, micro-batch {args.batch_size} x {args.seq_len} tokens, "
        f"accum {args.grad_accum_steps}, {args.steps} timed steps after {args.warmup} warm-up"
    )
    rows = [(prec, measure(args, prec)) for prec in args.precision.split(",")]
    base = rows[0][1]["tokens_per_s"]
    print()
    print("| precision | params | step time (s) | tokens/s | vs first row | peak RSS (GiB) |")
    print("|---|---|---|---|---|---|")
    for prec, r in rows:
        print(
            f"| {prec} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s'] / base:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} |"
        )


if __name__ == "__main__":
    main()

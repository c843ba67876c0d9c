#!/usr/bin/env python3
"""Optimizer parity on real text: one model trained on the default corpus (Shakespeare) with
each optimizer on the same batches in the same order (same seed and sampler), each at three
learning rates around its usual one; per optimizer its best held-out perplexity against
AdamW's best, its state bytes per parameter and its step time.

    python bench/optimizer_parity.py --steps 600

Results: docs/results/optimizers.md.

Targets (issue K): AdamW8bit within 1% of AdamW, Lion and Adafactor within 5%, GaLore (rank 128)
within 10%. The learning-rate grids: AdamW and AdamW8bit around the demo's 2e-3; Lion 3-10x
smaller (its update is a sign, every coordinate moves by lr); Adafactor around torch's default
1e-2 (its step is relative to each parameter's RMS); GaLore around AdamW's (its update is scaled
by --optim.galore_scale). Runs use the reference trainer (state on the device): the tiered
runtime gives the same losses (tests/optim/test_optimizers.py), so this measures the
optimizers only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

from tierlm.config import from_dict
from tierlm.optim import model_state_nbytes
from tierlm.train import Trainer

GRIDS = {
    "AdamW": (1e-3, 2e-3, 4e-3),
    "AdamW8bit": (1e-3, 2e-3, 4e-3),
    "Lion": (1.5e-4, 3e-4, 6e-4),
    "Adafactor": (5e-3, 1e-2, 2e-2),
    "GaLoreAdamW": (2e-3, 4e-3, 8e-3),
}
TARGET_GAP = {"AdamW": None, "AdamW8bit": 0.01, "Lion": 0.05, "Adafactor": 0.05,
              "GaLoreAdamW": 0.10}


def config(args: argparse.Namespace, name: str, lr: float, out: str) -> object:
    optim = {"name": name, "lr": lr, "warmup_steps": args.warmup}
    if name == "Lion":
        optim["beta2"] = 0.99  # the paper's default
    if name == "GaLoreAdamW":
        optim["galore_rank"] = args.galore_rank
    return from_dict({
        "model": {"size": args.model_size},
        "data": {"seq_len": args.seq_len},
        "optim": optim,
        "train": {"max_steps": args.steps, "batch_size": args.batch_size, "eval_every": 0,
                  "eval_batches": args.eval_batches, "sample_tokens": 0},
        "monitor": {"log_every": max(1, args.steps // 10)},
        "run": {"out": out, "seed": args.seed, "device": "cpu"},
    })


def run(args: argparse.Namespace, name: str, lr: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = config(args, name, lr, out)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, log=lambda _msg: None)
        result = trainer.train()
        wall_s = time.perf_counter() - t0
        tail = result.losses[-max(1, args.steps // 10):]
        return {
            "lr": lr,
            "ppl0": result.eval_ppl[0],
            "ppl": result.eval_ppl[args.steps],
            "train_loss": statistics.fmean(tail),
            "step_s": wall_s / args.steps,
            "state_bpp": model_state_nbytes(trainer.model, cfg.optim) / trainer.n_params,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="small")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--galore-rank", type=int, default=128)
    p.add_argument("--optimizers", default=",".join(GRIDS),
                   help="comma-separated; AdamW is required: every gap is measured against it")
    p.add_argument("--lrs", type=int, default=3, choices=(1, 3),
                   help="learning rates per optimizer: 3 (its grid) or 1 (the grid's middle)")
    p.add_argument("--extra", default="",
                   help="more learning rates to try, e.g. Lion=6e-4,AdamW8bit=1e-3")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--results", default="",
                   help="a JSON-lines file of finished runs: a run with the same settings found "
                   "there is not repeated, each new one is appended (a sweep split over sessions)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.optimizers.split(",")
    unknown = [n for n in names if n not in GRIDS]
    if unknown or "AdamW" not in names:
        p.error(f"--optimizers {args.optimizers}: AdamW is required; choose from "
                f"{', '.join(GRIDS)}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"model {args.model_size}, {args.steps} steps of {args.batch_size} x {args.seq_len} "
          f"tokens, warm-up {args.warmup}, seed {args.seed}; held-out: {args.eval_batches} "
          f"batches; GaLore rank {args.galore_rank}")
    key = {k: getattr(args, k) for k in ("model_size", "steps", "batch_size", "seq_len",
                                         "warmup", "eval_batches", "seed", "galore_rank")}
    cached = {}
    if args.results and os.path.exists(args.results):
        with open(args.results) as f:
            for line in f:
                r = json.loads(line)
                if r.pop("key") == key:
                    cached[(r.pop("optimizer"), r["lr"])] = r
    best: dict[str, dict] = {}
    sweeps: dict[str, list[dict]] = {}
    for name in names:
        grid = GRIDS[name] if args.lrs == 3 else GRIDS[name][1:2]
        grid += tuple(float(v) for k, v in (e.split("=") for e in args.extra.split(",") if e)
                      if k == name)
        # every rate this sweep has tried so far (--results), in order
        grid = sorted(set(grid) | {lr for n, lr in cached if n == name})
        for lr in grid:
            r = cached.get((name, lr)) or run(args, name, lr)
            if args.results and (name, lr) not in cached:
                with open(args.results, "a") as f:
                    f.write(json.dumps({"key": key, "optimizer": name, **r}) + "\n")
            sweeps.setdefault(name, []).append(r)
            print(f"  {name} lr {lr:g}: held-out ppl {r['ppl']:.3f} "
                  f"({r['step_s']:.2f} s/step)", file=sys.stderr, flush=True)
        best[name] = min(sweeps[name], key=lambda r: r["ppl"] if math.isfinite(r["ppl"])
                         else math.inf)
    base = best["AdamW"]
    print()
    print("| optimizer | lrs tried: held-out ppl | best lr | held-out ppl (step 0 -> end) "
          "| vs AdamW | target | state B/param | step (s) | vs AdamW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = best[name]
        gap = r["ppl"] / base["ppl"] - 1
        target = TARGET_GAP[name]
        verdict = "-" if target is None else (
            f"<= {target:.0%}: {'met' if gap <= target else 'MISSED'}")
        tried = ", ".join(f"{s['lr']:g}: {s['ppl']:.2f}" for s in sweeps[name])
        print(f"| {name} | {tried} | {r['lr']:g} | {r['ppl0']:.1f} -> {r['ppl']:.3f} "
              f"| {gap:+.2%} | {verdict} | {r['state_bpp']:.2f} | {r['step_s']:.3f} "
              f"| {r['step_s'] / base['step_s']:.2f}x |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Gradient sync strategies on real text: held-out perplexity and network bytes per step.

Each row trains the same model (`small` preset by default) on the built-in Shakespeare corpus
with 2 ranks (`tierlm train --nproc 2`, gloo) for the same steps on the same batches, then
reads the held-out perplexity at the end and the ledger's bytes sent per step from
metrics.jsonl. Ratios are against the dense all-reduce row of the same run and seed.

With several seeds (`--seeds 0,1`, each seed a different initialisation and data order) every
row is trained once per seed and its ratio to dense is taken per seed; the table shows the
mean ratio and the spread (min..max) over seeds, and a dense row per extra seed shows how far
apart two equally good runs land, which is the scale a parity target has to be read against.

    python bench/sync_parity.py --steps 150
    python bench/sync_parity.py --steps 150 --seeds 0,1 --only delayed
    python bench/sync_parity.py --steps 150 --only "sensitive layers dense"

Results: none recorded yet; the first run starts docs/results/multi-gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = [
    ("dense all-reduce (fp32)", []),
    ("topk 0.05, error feedback", ["--sparse-grad-ratio", "0.05",
                                   "--sparse-grad-ratio-overrides", ""]),
    ("topk 0.05, no error feedback", ["--sparse-grad-ratio", "0.05",
                                      "--sparse-grad-ratio-overrides", "",
                                      "--distributed.error_feedback", "false"]),
    ("topk 0.05, sensitive layers dense", ["--sparse-grad-ratio", "0.05"]),
    ("topk 0.05, ef21 feedback", ["--sparse-grad-ratio", "0.05",
                                  "--sparse-grad-ratio-overrides", "",
                                  "--distributed.topk_feedback", "ef21"]),
    ("topk 0.05, ef21 feedback, sensitive layers dense", [
        "--sparse-grad-ratio", "0.05", "--distributed.topk_feedback", "ef21"]),
    # how far the ratio has to rise before top-k comes near dense
    ("topk 0.2, error feedback, sensitive layers dense", ["--sparse-grad-ratio", "0.2"]),
    ("topk 0.2, ef21 feedback, sensitive layers dense", [
        "--sparse-grad-ratio", "0.2", "--distributed.topk_feedback", "ef21"]),
    # the warm-up's length is filled in from --steps (a fifth of them)
    ("topk 0.05, error feedback, dense warm-up (20% of steps)", [
        "--sparse-grad-ratio", "0.05", "--sparse-grad-ratio-overrides", "",
        "--distributed.sparse_warmup_steps", "{warmup}"]),
    ("delayed k=2", ["--sync-every", "2"]),
    ("delayed k=4", ["--sync-every", "4"]),
    ("delayed k=2, moments averaged (bf16)", ["--sync-every", "2", "--sync-moments", "average"]),
    ("delayed k=4, moments averaged (bf16)", ["--sync-every", "4", "--sync-moments", "average"]),
]


def run(name: str, extra: list[str], args, root: Path, seed: int) -> dict:
    out = root / ("".join(c if c.isalnum() else "_" for c in name) + f"_seed{seed}")
    extra = [x.format(warmup=max(1, args.steps // 5)) for x in extra]
    cmd = [
        sys.executable, "-m", "tierlm", "train", "--nproc", str(args.nproc),
        "--model-size", args.model_size, "--max-steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--lr", str(args.lr), "--optim.warmup_steps", str(args.warmup),
        "--eval-every", "0", "--train.eval_batches", str(args.eval_batches),
        "--train.sample_tokens", "0", "--save-every", "0", "--seed", str(seed),
        "--out", str(out), *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "step" in r]
    evals = [r for r in recs if "eval_ppl" in r]
    return {
        "ppl": evals[-1]["eval_ppl"],
        "sent_bytes": statistics.mean(r["net_send_bytes"] for r in steps),
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "wall_s": wall_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--only", default=None, help="run only rows whose name contains this")
    p.add_argument("--seeds", default="0",
                   help="comma-separated seeds; every row runs once per seed (default: 0)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

    rows = [r for r in ROWS if args.only is None or args.only in r[0]]
    if rows[0] is not ROWS[0]:
        rows.insert(0, ROWS[0])  # the baseline is always measured in the same run
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sync-parity-") as tmp:
        for seed in seeds:
            for name, extra in rows:
                r = run(name, extra, args, Path(tmp), seed)
                results.setdefault(name, []).append(r)
                print(f"  seed {seed} {name}: {r}", file=sys.stderr, flush=True)
    base = results[ROWS[0][0]]
    seed_txt = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {args.seeds}, mean over seeds"
    print(f"\n{args.nproc} ranks (gloo), `{args.model_size}` preset, Shakespeare, {args.steps} "
          f"steps of {args.nproc} x {args.batch_size} x {args.seq_len} tokens, lr {args.lr}, "
          f"{seed_txt}; held-out perplexity at the end; bytes sent per rank and step (ledger, "
          "ring all-reduce / all-gather accounting)\n")
    spread = len(seeds) > 1
    print("| sync | held-out ppl | ppl vs dense |" + (" spread over seeds |" if spread else "")
          + " bytes sent/step | bytes vs dense | step s (median) | wall s |")
    print("| --- | ---: | ---: |" + (" ---: |" if spread else "") + " ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        ratios = [r["ppl"] / b["ppl"] - 1 for r, b in zip(runs, base, strict=True)]
        ppl = statistics.mean(r["ppl"] for r in runs)
        sent = statistics.mean(r["sent_bytes"] for r in runs)
        base_sent = statistics.mean(b["sent_bytes"] for b in base)
        cells = [name, f"{ppl:.2f}", f"{statistics.mean(ratios):+.2%}"]
        if spread:
            cells.append(f"{min(ratios):+.2%} .. {max(ratios):+.2%}")
        cells += [f"{sent / 2**20:.2f} MiB", f"{sent / base_sent:.3f}",
                  f"{statistics.median(r['step_s'] for r in runs):.2f}",
                  f"{sum(r['wall_s'] for r in runs):.0f}"]
        print("| " + " | ".join(cells) + " |")
    if spread:  # how far apart equally configured dense runs land: the noise floor
        ppls = [b["ppl"] for b in base]
        print(f"\ndense held-out ppl per seed: {', '.join(f'{x:.2f}' for x in ppls)} "
              f"(max/min - 1 = {max(ppls) / min(ppls) - 1:.2%})")


if __name__ == "__main__":
    main()

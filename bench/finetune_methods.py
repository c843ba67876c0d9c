#!/usr/bin/env python3
"""Full fine-tuning, LoRA and QLoRA on one pretrained model: quality, memory, time, checkpoints.

The same pretrained small model (a local Hugging Face directory, `--model`; without it, the one
bench/finetune_e2e.py pretrains: `make train`'s run on the built-in Shakespeare plays, reused when
WORK/pretrain/hf exists) is fine-tuned for the same steps on the same text with
`--finetune full`, `lora` and `qlora`, each through the tiered runtime with the same placement
(`--offload-policy`, default host: the weights, or the frozen base, streamed from host RAM). The
text is the built-in corpus's held-out plays (Hamlet, Henry V, The Tempest, Twelfth Night), which
the pretraining never saw, written as one file; tierlm holds out its last 5% for evaluation.

Per method: held-out perplexity at step 0 and at the end (the run's own evaluation; QLoRA's step
0 is the NF4 base, so the quantisation's cost shows there), the ledger's peak device and host
bytes, the process's peak RSS (wait4's ru_maxrss, the whole process: imports and data included),
the median step time (steps after the first), the trained parameters and the final checkpoint's
size on disk. Learning rates differ by method (adapters take a larger one), as is usual; they
are printed.

    python bench/finetune_methods.py --model runs/demo/hf      # `make train`'s export
    python bench/finetune_methods.py                           # pretrains (or reuses) one

Results: docs/results/lora-qlora.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("full", "lora", "qlora")


def run_cli(args: list[str], log: Path) -> tuple[float, int]:
    """`tierlm ARGS` in a subprocess logged to `log`: its wall seconds and peak RSS bytes."""
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tierlm", *args], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": path}, stdout=f,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"tierlm {args[0]} failed ({proc.returncode}); see {log}:\n"
                 + "".join(log.read_text().splitlines(keepends=True)[-30:]))
    return time.perf_counter() - t0, usage.ru_maxrss * 1024


def held_out_plays_text(path: Path) -> Path:
    """The built-in corpus's held-out plays as one text file."""
    sys.path.insert(0, str(ROOT / "src"))
    from tierlm.data.corpus import load_corpus

    corpus = load_corpus(None, None)
    path.write_text("\n\n".join(doc.text for doc in corpus.eval), encoding="utf-8")
    return path


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def summarise(run: Path, wall_s: float, rss: int) -> dict:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval_ppl" in r]
    steps = [r for r in recs if "step_time_s" in r]
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    return {
        "ppl_before": evals[0]["eval_ppl"], "ppl_after": evals[-1]["eval_ppl"],
        "device_peak": max(r["device_peak_bytes"] for r in steps),
        "host_peak": max(r["host_peak_bytes"] for r in steps),
        "rss_peak": rss,
        "step_s": statistics.median(r["step_time_s"] for r in steps[1:] or steps),
        "checkpoint": dir_bytes(ckpts[-1]) if ckpts else 0,
        "adapter": dir_bytes(run / "adapter") if (run / "adapter").is_dir() else 0,
        "wall_s": wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local HF model directory (with its tokenizer)")
    ap.add_argument("--work", default="runs/finetune-methods", help="where runs go")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--offload-policy", default="host")
    ap.add_argument("--lr-full", type=float, default=3e-4)
    ap.add_argument("--lr-lora", type=float, default=2e-3, help="lora and qlora")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="every method's (bf16: full's bf16 compute copies, lora's bf16 base, "
                    "qlora's NF4 decoded to bf16)")
    args = ap.parse_args()
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]

    if args.model:
        model = Path(args.model).resolve()
    else:  # bench/finetune_e2e.py's pretrained model: `make train`'s run, kept under WORK
        model = work / "pretrain" / "hf"
        if not (model / "config.json").is_file():
            run_cli(["train", "--config", "configs/demo.yaml", "--out", str(model.parent),
                     "--device", "cpu", "--overwrite"], work / "pretrain.log")
    text = held_out_plays_text(work / "held_out_plays.txt")

    results = {}
    for method in args.methods.split(","):
        run = work / method
        lr = args.lr_full if method == "full" else args.lr_lora
        wall, rss = run_cli([
            "train", "--model", str(model), "--data", str(text), "--finetune", method,
            "--lora.rank", str(args.rank), "--lora.alpha", str(2 * args.rank),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--max-steps", str(args.steps), "--lr", str(lr), "--optim.warmup_steps", "3",
            "--eval-every", "0", "--train.eval_batches", str(args.eval_batches),
            "--train.sample_tokens", "0", "--precision", args.precision,
            "--offload-policy", args.offload_policy, "--out", str(run), "--device", "cpu",
            "--seed", str(args.seed), "--overwrite",  # the previous bench's run of it
        ], work / f"{method}.log")
        results[method] = {**summarise(run, wall, rss), "lr": lr}
        print(f"{method}: done in {wall:.0f} s", flush=True)

    mib = 2**20
    print(f"\nmodel: {model}; text: {text.name} (the held-out plays; tierlm holds out its last "
          f"5%); {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, "
          f"--offload-policy {args.offload_policy}, {args.precision}, rank {args.rank} "
          f"(alpha {2 * args.rank})"
          "\n")
    print("| method | lr | held-out ppl before | after | device peak MiB | host peak MiB "
          "| peak RSS MiB | step s (median) | checkpoint MiB | adapter MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, r in results.items():
        print(f"| {method} | {r['lr']:g} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} "
              f"| {r['device_peak'] / mib:.1f} | {r['host_peak'] / mib:.1f} "
              f"| {r['rss_peak'] / mib:.0f} | {r['step_s']:.2f} | {r['checkpoint'] / mib:.2f} "
              f"| {r['adapter'] / mib:.2f} |")
    if "full" in results:
        base = results["full"]
        print("\nratios to full (same run): "
              + "; ".join(f"{m}: host peak {r['host_peak'] / base['host_peak']:.2f}x, "
                          f"step {r['step_s'] / base['step_s']:.2f}x, checkpoint "
                          f"{r['checkpoint'] / base['checkpoint']:.3f}x"
                          for m, r in results.items() if m != "full"))
    print(f"load average (1 min) at start {load_start:.1f}, at the end "
          f"{os.getloadavg()[0]:.1f}, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The allocator tax: the reference trainer's step with and without a process-wide mmap threshold.

Until issue U, `train/safety.return_freed_buffers` set glibc's M_MMAP_THRESHOLD to 128 KiB for
every run, so every activation and gradient buffer torch allocated was a fresh mapping that the
kernel faulted in and zeroed, every step. Now torch's buffers keep glibc's defaults and only the
runtime's own host buffers are mappings (tierlm.memory.disk.mapped_empty). This bench times
tierlm's reference trainer (`--offload-policy none`) on a random-weight checkpoint of a
135M-parameter Llama shape (30 blocks, hidden 576, 9 heads, 3 KV heads, intermediate 1536,
tied 49,152-token vocabulary), fp32 AdamW, clipping 1.0, in two variants, each in its own
subprocess and alternating for `--rounds` rounds:

- `glibc defaults`: this code as it is;
- `mallopt 128 KiB`: the same, with the old `mallopt(M_MMAP_THRESHOLD, 128 KiB)` called first.

Printed: median step time of each variant (over all its rounds' timed steps), the ratio to the
defaults, and the peak RSS (VmHWM) of the process.

`--phases` also runs bench/scale.py (issue I's per-phase table: load, steps, eval, checkpoint,
export, sample, each phase's peak RSS against the budgets + 1 GiB) in both variants, with the
same shape as a Llama checkpoint (`--shape smollm-135m`) and budgets of half its training state
(384 MiB device + 640 MiB host: the planner asks for at least 569 MiB of host RAM here).

    python bench/allocator.py --rounds 2 --steps 2 --phases

Results: docs/results/allocator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OLD_MALLOPT = "import ctypes; ctypes.CDLL('libc.so.6').mallopt(-3, 128 * 1024)\n"
VARIANTS = {"glibc defaults": "", "mallopt 128 KiB": OLD_MALLOPT}

CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
from tierlm.config import from_dict
from tierlm.train import Trainer

model_dir, data, out, micro, batch, seq, warmup, steps = sys.argv[1:9]
cfg = from_dict({
    "model": {"path": model_dir},
    "data": {"seq_len": int(seq), "train": data},
    "optim": {"name": "AdamW", "lr": 1e-4, "grad_clip": 1.0},
    "train": {"max_steps": int(warmup) + int(steps), "batch_size": int(batch),
              "grad_accum_steps": int(micro), "eval_every": 0, "eval_batches": 1,
              "sample_tokens": 0, "save_final": False},
    "precision": {"mode": "fp32"},
    "memory": {"offload_policy": "none"},
    "run": {"out": out, "device": "cpu", "seed": 0},
})
trainer = Trainer(cfg, log=lambda m: None)
times, losses = [], []
for i in range(int(warmup) + int(steps)):
    rec = trainer.train_step()
    losses.append(rec["loss"])
    if i >= int(warmup):
        times.append(rec["step_time_s"])
hwm = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmHWM:"))
print("RESULT", json.dumps({"times": times, "losses": losses, "peak_rss_bytes": hwm,
                            "params": trainer.n_params}))
"""

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def write_model(out: Path, layers: int) -> int:
    """A random-weight Llama checkpoint of the 135M shape (fp32) with a small BPE tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierlm.data import train_bpe_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    train_bpe_tokenizer([corpus_text()], vocab_size=4096).save_pretrained(out)
    return n


def corpus_text() -> str:
    words = ("the quick brown fox jumps over the lazy dog while a small model learns to read "
             "every line of this text twice").split()
    return "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40))
                     for i in range(3000))


def run_child(prelude: str, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", prelude + CHILD, *args], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"bench child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.split("RESULT")[-1])


def run_phases(prelude: str, args: argparse.Namespace, work: Path) -> list[str]:
    """bench/scale.py's per-phase table, in a process that runs `prelude` first."""
    script = (prelude + "import runpy, sys\n"
              f"sys.argv = {['scale.py', '--shape', 'smollm-135m', '--dir', str(work), '--device-budget', args.device_budget, '--host-budget', args.host_budget, '--steps', '2']!r}\n"  # noqa: E501
              f"runpy.run_path({str(ROOT / 'bench' / 'scale.py')!r}, run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"bench/scale.py failed:\n{proc.stderr[-4000:]}")
    return [line for line in proc.stdout.splitlines() if line.startswith("|") or
            line.startswith("smollm-135m,")]


def print_steps(results: dict[str, list[dict]], args: argparse.Namespace, n: int) -> None:
    print()
    print(f"tierlm reference trainer (--offload-policy none), random-weight Llama "
          f"{n / 1e6:.1f}M params ({args.layers} blocks, hidden 576, 9/3 heads, "
          f"intermediate 1536, tied 49152 vocabulary), fp32 AdamW, clip 1.0, "
          f"{args.micro_batches} micro-batches of {args.batch_size} x {args.seq_len} tokens; "
          f"{args.rounds} rounds x {args.steps} timed steps per variant (after "
          f"{args.warmup} warm-up), variants alternating, each in its own process")
    print()
    print("| variant | median step s | vs glibc defaults | peak RSS GiB | losses (round 1) |")
    print("|---|---:|---:|---:|---|")
    base = statistics.median(t for res in results["glibc defaults"] for t in res["times"])
    for v, runs in results.items():
        med = statistics.median(t for res in runs for t in res["times"])
        peak = max(res["peak_rss_bytes"] for res in runs)
        losses = ", ".join(f"{x:.4f}" for x in runs[0]["losses"])
        print(f"| {v} | {med:.2f} | {med / base:.2f}x | {peak / 2**30:.2f} | {losses} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="0: only --phases")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=30, help="blocks (30: the 135M shape)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--phases", action="store_true",
                   help="also bench/scale.py's per-phase RSS table in both variants")
    p.add_argument("--device-budget", default="384MiB")
    p.add_argument("--host-budget", default="640MiB")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        n = write_model(work / "model", args.layers) if args.rounds else 0
        (work / "data.txt").write_text(corpus_text())
        shape = [str(args.micro_batches), str(args.batch_size), str(args.seq_len),
                 str(args.warmup), str(args.steps)]
        results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for i, v in enumerate(order):
                run_dir = work / f"run-{r}-{i}"  # a new run each time
                res = run_child(VARIANTS[v], [str(work / "model"), str(work / "data.txt"),
                                              str(run_dir), *shape])
                results[v].append(res)
                print(f"round {r + 1} {v}: steps {', '.join(f'{t:.2f}' for t in res['times'])}"
                      f" s, peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)

        if args.rounds:
            print_steps(results, args, n)
        if args.phases:
            for v, prelude in VARIANTS.items():
                print()
                print(f"bench/scale.py --shape smollm-135m --device-budget {args.device_budget} "
                      f"--host-budget {args.host_budget} --steps 2, {v}:")
                print()
                for line in run_phases(prelude, args, work / "scale"):
                    print(line)


if __name__ == "__main__":
    main()

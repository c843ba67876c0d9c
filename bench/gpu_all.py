#!/usr/bin/env python3
"""The sections of bench/gpu_all.sh's results file that need Python: the environment, and the
tables of the pinned-bytes, streamed-step and fp8 stages from bench/gpu_run.py's JSON files.

    python bench/gpu_all.py env
    python bench/gpu_all.py pinned RUN.json
    python bench/gpu_all.py stream TIERED.json PLAIN.json
    python bench/gpu_all.py fp8 KERNEL.json EMULATED.json

A missing JSON file (its run was skipped, timed out or failed) prints a row that says so; the
shell script has already written why into the results file.

Results: docs/results/<date>-gpu.md, written by bench/gpu_all.sh (one file per GPU run).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from pathlib import Path

GIB = 2**30
DEV_TORCH = "2.13"  # the development machine's torch (docs: /work/shared/PLATFORM_NOTES.md)


def _load(path: str) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def env() -> None:
    import torch

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    print(f"- python {platform.python_version()} ({sys.executable})")
    print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}); the repo is developed "
          f"against torch {DEV_TORCH}")
    for pkg in ("transformers", "tokenizers", "pytest", "pytest-timeout"):
        print(f"- {pkg} {version(pkg)}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"- GPU {props.name}, {props.total_memory / GIB:.1f} GiB, "
              f"sm_{props.major}{props.minor}")
    else:
        print("- no CUDA device")


def pinned(path: str) -> None:
    r = _load(path)
    if r is None:
        print("no result (the run did not finish; see above)")
        return
    stats = r.get("pinned_stats")
    ledger = r.get("ledger_host_peak_bytes")
    planned = r.get("predicted_host_peak_bytes")
    print(f"\nrun: {r['label']}\n")
    print("| what | GiB |\n| --- | --- |")
    print(f"| ledger: host tier peak (pinned or not) | {_gib(ledger)} |")
    print(f"| plan: host tier peak | {_gib(planned)} |")
    if not stats:
        print("\nno CUDA: nothing pinned")
        return
    keys = [k for k in ("allocated_bytes.peak", "allocated_bytes.current", "active_bytes.peak")
            if k in stats] or sorted(stats)  # another torch may name its counters otherwise
    for key in keys:
        print(f"| CUDA pinned allocator {key} | {_gib(stats[key])} |")
    peak = stats.get("allocated_bytes.peak")
    if peak and ledger:
        print(f"\npinned peak / ledger host peak: {peak / ledger:.2f}x (memory pinned with "
              "cudaHostRegister, outside torch's allocator, is not in these counters)")


def stream(tiered_path: str, plain_path: str) -> None:
    rows = [("streamed from host RAM", _load(tiered_path)), ("plain PyTorch", _load(plain_path))]
    print("| run | stepper | precision | tokens/s | step s | peak device GiB "
          "(max_memory_allocated) | losses |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        if r is None:
            print(f"| {name} | did not finish (see above) | | | | | |")
            continue
        tps = r.get("tokens_per_s")
        step = r.get("step_s")
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses", []))
        print(f"| {name} | {r['stepper']} | {r['precision']} | "
              f"{'-' if tps is None else f'{tps:,.0f}'} | "
              f"{'-' if step is None else f'{step:.3f}'} | "
              f"{_gib(r.get('cuda_max_allocated_bytes'))} | {losses} |")
    t, p = rows[0][1], rows[1][1]
    if t and p and t.get("tokens_per_s") and p.get("tokens_per_s"):
        print(f"\nstreamed / plain tokens/s: {t['tokens_per_s'] / p['tokens_per_s']:.2f}x")


def fp8(kernel_path: str, emulated_path: str) -> None:
    k, e = _load(kernel_path), _load(emulated_path)
    print("| run | precision | tokens/s | losses |\n| --- | --- | --- | --- |")
    for name, r in (("`_scaled_mm` kernels", k), ("`--fp8-emulate`", e)):
        if r is None:
            print(f"| {name} | did not run (see above) | | |")
            continue
        tps = r.get("tokens_per_s")
        print(f"| {name} | {r['precision']} | {'-' if tps is None else f'{tps:,.0f}'} | "
              + ", ".join(f"{x:.4f}" for x in r["losses"]) + " |")
    if k and e:
        worst = max(abs(a - b) / abs(b) for a, b in zip(k["losses"], e["losses"], strict=True))
        print(f"\nlargest relative loss difference, kernels vs emulation: {worst:.2e} "
              f"(target: at most 1e-2)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("env")
    sub.add_parser("pinned").add_argument("run")
    s = sub.add_parser("stream")
    s.add_argument("tiered")
    s.add_argument("plain")
    f = sub.add_parser("fp8")
    f.add_argument("kernel")
    f.add_argument("emulated")
    args = p.parse_args()
    if args.command == "env":
        env()
    elif args.command == "pinned":
        pinned(args.run)
    elif args.command == "stream":
        stream(args.tiered, args.plain)
    else:
        fp8(args.kernel, args.emulated)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The disk tier really saves RAM: train a model whose master weights + AdamW state are several
times the host budget, with master weights, gradients and optimizer state in files.

Prints step time, disk bytes per step, the disk throughput the optimizer update achieves (it
reads master, gradient and both moments and writes master and moments back) next to `dd` with
O_DIRECT on the same directory in the same run, and the process's peak RSS against the budget.

    python bench/disk_tier.py --model-size 350m --host-budget 1.5GiB --steps 3

On a CPU-only machine the "device" is this process's RAM too: its ledger bytes are reported
separately and belong to the fixed overhead, with the Python/torch runtime itself.

Results: none recorded yet; a run goes in docs/results/scale.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import tempfile
import time
from pathlib import Path

import torch

from tierlm.config import OptimConfig, parse_bytes
from tierlm.memory.disk import dd_throughput
from tierlm.memory.tiers import Link, Tier
from tierlm.models import build_model, preset_config
from tierlm.runtime import EngineOptions, build_engine

GiB = 2**30


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="350m")
    p.add_argument("--host-budget", default="1.5GiB")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir in .)")
    p.add_argument("--dd-mib", type=int, default=1024)
    args = p.parse_args()
    host_budget = parse_bytes(args.host_budget)

    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix=".bench-offload-") as off:
        dd_write, dd_read = dd_throughput(Path(off), args.dd_mib * 2**20)
        base_rss = rss_bytes()
        cfg = preset_config(args.model_size, max_seq_len=args.seq_len)
        model = build_model(cfg, device="cpu", seed=0)
        n_params = sum(p.numel() for p in model.parameters())
        opts = EngineOptions(
            policy="disk", host_budget_bytes=host_budget, offload_dir=off,
            batch_size=args.batch_size, seq_len=args.seq_len,
        )
        eng = build_engine(model, OptimConfig(lr=1e-4), opts, device=torch.device("cpu"))
        trim()
        setup_rss = rss_bytes()
        reset_peak_rss()
        g = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(args.steps):
            batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                                  generator=g)
            before = dict(eng.ledger.total_moved_bytes)
            t0 = time.perf_counter()
            out = eng.step([batch], 1e-4)
            t1 = time.perf_counter()
            mid = dict(eng.ledger.total_moved_bytes)
            eng.synchronize()  # the update phase on its own (normally overlapped)
            t2 = time.perf_counter()
            after = dict(eng.ledger.total_moved_bytes)

            def moved(link, a, b):
                return b.get(link, 0) - a.get(link, 0)

            upd_r = moved(Link.DISK_READ, mid, after)
            upd_w = moved(Link.DISK_WRITE, mid, after)
            rows.append(dict(
                loss=out["loss"], fwd_bwd_s=t1 - t0, update_s=t2 - t1,
                read=moved(Link.DISK_READ, before, after),
                write=moved(Link.DISK_WRITE, before, after),
                upd_bps=(upd_r + upd_w) / (t2 - t1),
                # time dd would need for the same reads and writes, as a rate
                dd_bps=(upd_r + upd_w) / (upd_r / dd_read + upd_w / dd_write),
            ))
        peak_rss = rss_bytes("VmHWM")
        host_peak = eng.ledger.peak_tier_bytes[Tier.HOST]
        device_peak = eng.ledger.peak_tier_bytes[Tier.DEVICE]
        disk_bytes = eng.ledger.tier_bytes(Tier.DISK)
        eng.close()

    state = n_params * 12
    print(f"model {args.model_size}: {n_params / 1e6:.0f}M params; master + AdamW state "
          f"{state / GiB:.2f} GiB = {state / host_budget:.1f}x the host budget "
          f"({host_budget / GiB:.2f} GiB); disk tier holds {disk_bytes / GiB:.2f} GiB")
    print(f"dd O_DIRECT on the offload dir: write {dd_write / 1e9:.2f} GB/s, "
          f"read {dd_read / 1e9:.2f} GB/s")
    print()
    print("| step | loss | fwd+bwd (s) | update (s) | disk read GB | disk write GB "
          "| update disk GB/s | dd same mix GB/s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['loss']:.3f} | {r['fwd_bwd_s']:.1f} | {r['update_s']:.1f} "
              f"| {r['read'] / 1e9:.2f} | {r['write'] / 1e9:.2f} | {r['upd_bps'] / 1e9:.2f} "
              f"| {r['dd_bps'] / 1e9:.2f} | {r['upd_bps'] / r['dd_bps']:.2f} |")
    print()
    print("| memory | GiB |")
    print("|---|---|")
    print(f"| host budget | {host_budget / GiB:.2f} |")
    print(f"| peak RSS during training (VmHWM) | {peak_rss / GiB:.2f} |")
    print(f"| RSS before building the model (Python + torch) | {base_rss / GiB:.2f} |")
    print(f"| RSS after setup | {setup_rss / GiB:.2f} |")
    print(f"| ledger peak, host tier | {host_peak / GiB:.2f} |")
    print(f"| ledger peak, device tier (this RAM on a CPU-only machine) | "
          f"{device_peak / GiB:.2f} |")
    overhead = base_rss + device_peak
    print(f"| peak RSS - (host budget + runtime + device tier) | "
          f"{(peak_rss - host_budget - overhead) / GiB:+.2f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What the gradient landing's staging ring costs on the CPU "device".

A device gradient is added into host RAM through a ring of two staging chunks
(tierlm.runtime.landing: D2H copy into the ring, then `host += staging`), on a CPU-only machine
as on a GPU. The engine holds one ring for the step (taken at its first landing, reused by the
rest); before, each landing allocated a fresh one. Before that, the CPU path added the device
tensor straight into the host buffer (one `host.add_(dev)`, no staging). This times the three
on gradients of a few sizes, interleaved so machine noise hits them alike, and prints median
milliseconds, the ratios to the direct add, and the ring's host staging bytes.

    python bench/grad_landing.py --numels 262144 4194304 37748736 --reps 7 [--threads 1]

Results: docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tierlm.memory.placement import STAGING_CHUNK_NUMEL
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.landing import LandingRing, add_to_host
from tierlm.runtime.schedule import landing_staging_numel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numels", type=int, nargs="+", default=[1 << 22, 37_748_736])
    p.add_argument("--chunk-numel", type=int, default=STAGING_CHUNK_NUMEL)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: as it is)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| gradient (MiB) | direct add (ms) | held ring (ms) | fresh ring (ms) | held / direct "
          "| fresh / direct | ring staging (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for numel in args.numels:
        dev = torch.randn(numel)
        host = torch.zeros(numel)
        store = Store(torch.device("cpu"))
        ring_numel = landing_staging_numel(numel, args.chunk_numel)
        times: dict[str, list[float]] = {"direct": [], "held": [], "fresh": []}
        with LandingRing(store, ring_numel) as held:  # the step's ring, over every landing
            for _ in range(args.reps + 1):  # the first of each is a warm-up
                t0 = time.perf_counter()
                host.add_(dev)
                times["direct"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                add_to_host(store, held, host, dev, args.chunk_numel)
                times["held"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with LandingRing(store, ring_numel) as fresh:  # one ring per landing
                    add_to_host(store, fresh, host, dev, args.chunk_numel)
                times["fresh"].append(time.perf_counter() - t0)
        d, h, f = (statistics.median(times[k][1:]) for k in ("direct", "held", "fresh"))
        # the held ring and a fresh one at once, at most
        assert store.ledger.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == 8 * ring_numel
        staged = 4 * ring_numel
        print(f"| {4 * numel / 2**20:.0f} | {d * 1e3:.2f} | {h * 1e3:.2f} | {f * 1e3:.2f} | "
              f"{h / d:.2f} | {f / d:.2f} | {staged / 2**20:.0f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What the gradient landing's staging ring costs on the CPU "device".

A device gradient is added into host RAM through a ring of two staging chunks
(tierlm.runtime.landing: D2H copy into the ring, then `host += staging`), on a CPU-only machine
as on a GPU. Before, the CPU path added the device tensor straight into the host buffer (one
`host.add_(dev)`, no staging). This times both on gradients of a few sizes, interleaved so
machine noise hits both alike, and prints median milliseconds, the ratio ring / direct, and the
ring's host staging bytes.

    python bench/grad_landing.py --numels 4194304 37748736 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tierlm.memory.placement import STAGING_CHUNK_NUMEL
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.landing import add_to_host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numels", type=int, nargs="+", default=[1 << 22, 37_748_736])
    p.add_argument("--chunk-numel", type=int, default=STAGING_CHUNK_NUMEL)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    print("| gradient (MiB) | direct add (ms) | ring (ms) | ring / direct | ring staging (MiB) |")
    print("|---|---|---|---|---|")
    for numel in args.numels:
        dev = torch.randn(numel)
        host = torch.zeros(numel)
        store = Store(torch.device("cpu"))
        direct, ring = [], []
        for _ in range(args.reps + 1):  # the first of each is a warm-up
            t0 = time.perf_counter()
            host.add_(dev)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            add_to_host(store, host, dev, args.chunk_numel)
            ring.append(time.perf_counter() - t0)
        d, r = statistics.median(direct[1:]), statistics.median(ring[1:])
        staged = store.ledger.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)]
        print(f"| {4 * numel / 2**20:.0f} | {d * 1e3:.1f} | {r * 1e3:.1f} | {r / d:.2f} | "
              f"{staged / 2**20:.0f} |")


if __name__ == "__main__":
    main()

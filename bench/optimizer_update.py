#!/usr/bin/env python3
"""Params/s of the CPU optimizer update over host-tier flat state (fp32 master and gradient),
for each optimizer against fused fp32 AdamW on the same tensors in the same run. Usage:

    python bench/optimizer_update.py [--matrices 4] [--size 4096] [--rounds 5]

The segment is `--matrices` linear weights of `--size` x `--size` (64M parameters by default).
Rounds interleave the optimizers, so machine noise hits all alike; the table gives the median
step time and the median over rounds of fused AdamW's time / the row's time.

Rows:
- fused AdamW: `torch.optim.adam.adam(fused=True)` on the flat buffer (the runtime's AdamW).
- AdamW8bit: `FlatAdamW8bit.update_range` over the segment (C kernel); the eager fallback is
  timed on the first `--eager-numel` elements only (it is an order of magnitude slower).
- GaLore rank r: `FlatGaLoreAdamW` on a step without a projection refresh; the refresh step
  (one SVD per matrix) is timed once, on one matrix, and reported per matrix and amortised
  over `--update-every` steps.
- Lion, Adafactor: the runtime's `FlatLion` and `FlatAdafactor` (C kernels); Adafactor's eager
  fallback (torch.optim.Adafactor's operations) over the whole segment too.

Results: docs/results/optimizers.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.optim.adam import adam

from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.optim.adafactor import FlatAdafactor
from tierlm.optim.adamw8bit import FlatAdamW8bit
from tierlm.optim.flat import FlatOptimizer
from tierlm.optim.galore import FlatGaLoreAdamW, galore_step
from tierlm.optim.lion import FlatLion

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
CFG = OptimConfig(beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)


def flat_state(opt: FlatOptimizer, layout: FlatLayout) -> dict[str, torch.Tensor]:
    out = {}
    for s in opt.slots:
        out[s.name] = torch.empty(s.numel(layout), dtype=s.dtype)
        opt.init_slot(s, layout, out[s.name])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--matrices", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--update-every", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager-numel", type=int, default=1 << 22)
    ap.add_argument("--no-svd", action="store_true", help="skip timing the projection refresh")
    args = ap.parse_args()

    n = args.size
    layout = FlatLayout([(f"w{i}", (n, n), True) for i in range(args.matrices)])
    numel = layout.numel
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-3)
    steps = [torch.zeros(())]

    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)

    def fused() -> None:
        adam([master], [grad], [exp_avg], [exp_avg_sq], [], [steps[0].clone()], fused=True,
             decoupled_weight_decay=True, amsgrad=False, beta1=BETAS[0], beta2=BETAS[1], lr=LR,
             weight_decay=WD, eps=EPS, maximize=False)

    q8 = FlatAdamW8bit(CFG)
    q8_state = flat_state(q8, layout)

    def adamw8bit() -> None:
        q8.update_range(layout, 0, master, grad, q8_state, steps, LR)

    eager_layout = FlatLayout([("w", (args.eager_numel,), True)])
    q8e = FlatAdamW8bit(CFG, native=False)
    q8e_state = flat_state(q8e, eager_layout)

    def adamw8bit_eager() -> None:
        q8e.update_range(eager_layout, 0, master[: args.eager_numel], grad[: args.eager_numel],
                         q8e_state, steps, LR)

    galore = FlatGaLoreAdamW(CFG, rank=args.rank, update_every=args.update_every, scale=0.25)
    galore_state = flat_state(galore, layout)
    galore_steps = [torch.ones(())]  # step 2: no refresh (the projection stays zero: same work)

    def galore_normal() -> None:
        galore.update_range(layout, 0, master, grad, galore_state, galore_steps, LR)

    views = layout.views(master)

    def flat(opt: FlatOptimizer) -> Callable[[], None]:
        state = flat_state(opt, layout)
        return lambda: opt.update_range(layout, 0, master, grad, state, steps, LR)

    lion, adafactor = flat(FlatLion(CFG)), flat(FlatAdafactor(CFG))
    adafactor_eager = flat(FlatAdafactor(CFG, native=False))

    rows: list[tuple[str, int, Callable[[], None]]] = [
        ("fused AdamW (fp32)", numel, fused),
        ("AdamW8bit (C kernel)", numel, adamw8bit),
        ("AdamW8bit (eager fallback)", args.eager_numel, adamw8bit_eager),
        (f"GaLore rank {args.rank}, step without refresh", numel, galore_normal),
        ("Lion (FlatLion, C kernel)", numel, lion),
        ("Adafactor (FlatAdafactor, C kernel)", numel, adafactor),
        ("Adafactor (eager fallback)", numel, adafactor_eager),
    ]
    for _, _, fn in rows:  # warm-up: first-touch pages, kernel build
        fn()
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        base = None
        for name, count, fn in rows:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            if base is None:
                base = dt / count
            ratios[name].append(base / (dt / count))

    svd_s = None
    if not args.no_svd:
        w, g = views["w0"], layout.views(grad)["w0"]
        proj = torch.zeros(args.rank, n)
        m, v = torch.zeros(n, args.rank), torch.zeros(n, args.rank)
        t0 = time.perf_counter()
        galore_step(w, g, proj, m, v, 1.0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                    scale=0.25, rank=args.rank, update_every=args.update_every)
        svd_s = time.perf_counter() - t0

    print(f"segment: {args.matrices} x ({n}, {n}) = {numel / 1e6:.1f}M params, fp32 master and "
          f"gradient; {args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print("| optimizer | params | median step s | G params/s | vs fused AdamW |")
    print("| --- | --- | --- | --- | --- |")
    for name, count, _ in rows:
        t = statistics.median(times[name])
        print(f"| {name} | {count / 1e6:.1f}M | {t:.3f} | {count / t / 1e9:.3f} | "
              f"{statistics.median(ratios[name]):.2f}x |")
    if svd_s is not None:
        base = statistics.median(times[rows[0][0]]) / numel
        per_matrix = n * n
        amortised = (svd_s + statistics.median(times[rows[3][0]]) / args.matrices *
                     (args.update_every - 1)) / args.update_every
        print(f"| GaLore refresh step (SVD), one ({n}, {n}) matrix | {per_matrix / 1e6:.1f}M | "
              f"{svd_s:.3f} | {per_matrix / svd_s / 1e9:.4f} | "
              f"{base * per_matrix / svd_s:.4f}x |")
        print(f"| GaLore amortised over {args.update_every} steps, one matrix | "
              f"{per_matrix / 1e6:.1f}M | {amortised:.3f} | {per_matrix / amortised / 1e9:.3f} | "
              f"{base * per_matrix / amortised:.2f}x |")


if __name__ == "__main__":
    main()

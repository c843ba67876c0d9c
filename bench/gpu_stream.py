#!/usr/bin/env python3
"""GPU check: a model streamed from host RAM with GPU memory capped (models a smaller card).

Prints tokens/s, torch.cuda.max_memory_allocated, and the H2D/D2H rates the runtime achieved
next to a plain pinned-memory copy measured in the same run.

    python bench/gpu_stream.py --model-size 1b --gpu-cap-gib 8 --steps 4

Results: none recorded yet; a run goes in docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from tierlm.config import OptimConfig
from tierlm.memory.tiers import Link
from tierlm.models import build_model, preset_config
from tierlm.runtime import EngineOptions, build_engine


def pinned_copy_gbps(nbytes: int = 1 << 30) -> tuple[float, float]:
    """H2D and D2H GB/s of a plain pinned copy, the rate the runtime's copies are judged by."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(3 * nbytes / (time.perf_counter() - t0) / 1e9)
    del host, dev
    torch.cuda.empty_cache()  # a later memory cap must not count these
    return rates[0], rates[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-size", default="1b")
    p.add_argument("--gpu-cap-gib", type=float, default=8.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--policy", default="host")
    args = p.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.gpu_cap_gib * 2**30 / total)
    h2d_peak, d2h_peak = pinned_copy_gbps()
    cfg = preset_config(args.model_size, max_seq_len=args.seq_len)
    model = build_model(cfg, device="cpu", seed=0)
    budget = int((args.gpu_cap_gib - 1.0) * 2**30)  # 1 GiB for the CUDA context and workspace
    eng = build_engine(
        model, OptimConfig(lr=1e-4),
        EngineOptions(policy=args.policy, device_budget_bytes=budget, batch_size=args.batch_size,
                      seq_len=args.seq_len, offload_dir="/tmp/tierlm-gpu-offload"),
        device=torch.device("cuda"),
    )
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    times, parts = [], []
    for i in range(args.steps):
        batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.step([batch], 1e-4)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        moved = dict(eng.ledger.moved_bytes)
        if i > 0:
            times.append(dt)
            parts.append((out["sweep_s"], out["transfer_wait_s"], out["update_wait_s"]))
        print(f"step {i}: loss {out['loss']:.3f}, {dt:.2f} s, H2D {moved[Link.H2D] / 1e9:.2f} GB, "
              f"D2H {moved[Link.D2H] / 1e9:.2f} GB")
    eng.synchronize()
    step_s = sum(times) / len(times)
    h2d = eng.ledger.moved_bytes[Link.H2D]
    d2h = eng.ledger.moved_bytes[Link.D2H]
    print()
    sweep, transfer_wait, update_wait = (sum(x) / len(parts) for x in zip(*parts, strict=True))
    print("| model | policy | GPU cap GiB | tokens/s | max_memory_allocated GiB | ledger device "
          "peak GiB | H2D GB/s (step avg) | D2H GB/s | pinned copy H2D / D2H GB/s "
          "| step s = sweep (of it: transfer wait, update wait) + after the sweep |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model_size} | {args.policy} | {args.gpu_cap_gib} "
          f"| {args.batch_size * args.seq_len / step_s:,.0f} "
          f"| {torch.cuda.max_memory_allocated() / 2**30:.2f} "
          f"| {eng.ledger.peak_tier_bytes['device'] / 2**30:.2f} "
          f"| {h2d / step_s / 1e9:.2f} | {d2h / step_s / 1e9:.2f} "
          f"| {h2d_peak:.1f} / {d2h_peak:.1f} "
          f"| {step_s:.2f} = {sweep:.2f} ({transfer_wait:.2f}, {update_wait:.2f}) "
          f"+ {step_s - sweep:.2f} |")
    eng.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Disk-tier staging in chunks against staging a whole segment, in the same process on the same
files, interleaved: the optimizer update of one large segment (a 152k-token embedding by
default) and the streamed read of its weights, with the disk throughput each achieves and the
host staging each holds (the ledger's peak).

    python bench/disk_chunks.py --dir /var/tmp/tierlm-chunks --reps 3

Results: docs/results/scale.md.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/tierlm-chunks")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, Qwen2Config

    from tierlm.config import OptimConfig
    from tierlm.memory.placement import STAGING_CHUNK_NUMEL
    from tierlm.memory.tiers import Tier
    from tierlm.runtime import EngineOptions, build_engine
    from tierlm.runtime.state import start_load

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    cfg = Qwen2Config(hidden_size=args.hidden, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
                      tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    eng = build_engine(model, OptimConfig(lr=1e-4),
                       EngineOptions(policy="disk", offload_dir=str(root)),
                       device=torch.device("cpu"))
    st = eng.states[0]
    n = st.numel
    whole = 1 << (n - 1).bit_length()  # one chunk: the segment staged whole, as before
    modes = {"whole segment": max(whole, STAGING_CHUNK_NUMEL),
             f"chunks of {STAGING_CHUNK_NUMEL * 4 // 2**20} MiB": STAGING_CHUNK_NUMEL}
    rows = {m: {"update_s": [], "load_s": [], "update_staging": 0, "load_staging": 0}
            for m in modes}
    coef = torch.tensor(1.0)
    dst = torch.empty(n)
    for _ in range(args.reps):
        for mode, chunk in modes.items():
            eng.chunk_numel = chunk
            led = eng.ledger
            led.peak_tier_bytes[Tier.HOST] = led.tier_bytes(Tier.HOST)
            t0 = time.perf_counter()
            eng._update(st, coef, 1e-4)
            rows[mode]["update_s"].append(time.perf_counter() - t0)
            rows[mode]["update_staging"] = led.peak_tier_bytes[Tier.HOST]
            led.peak_tier_bytes[Tier.HOST] = led.tier_bytes(Tier.HOST)
            t0 = time.perf_counter()
            start_load(eng.store, st, chunk).finish(dst)
            rows[mode]["load_s"].append(time.perf_counter() - t0)
            rows[mode]["load_staging"] = led.peak_tier_bytes[Tier.HOST]
    eng.close()
    shutil.rmtree(root, ignore_errors=True)

    upd_bytes, load_bytes = 28 * n, 4 * n  # update: read 4 copies, write 3; load: the master
    print(f"segment: {n / 1e6:.0f}M params ({args.vocab} x {args.hidden}); update moves "
          f"{upd_bytes / GiB:.2f} GiB, a load {load_bytes / GiB:.2f} GiB; median of {args.reps}, "
          "modes interleaved")
    print()
    print("| staging | update s | update GB/s | load s | load GB/s | host staging, update GiB "
          "| host staging, load GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        u = sorted(r["update_s"])[len(r["update_s"]) // 2]
        ld = sorted(r["load_s"])[len(r["load_s"]) // 2]
        print(f"| {mode} | {u:.2f} | {upd_bytes / u / 1e9:.2f} | {ld:.2f} | "
              f"{load_bytes / ld / 1e9:.2f} | {r['update_staging'] / GiB:.2f} | "
              f"{r['load_staging'] / GiB:.2f} |")


if __name__ == "__main__":
    main()

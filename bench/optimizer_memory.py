#!/usr/bin/env python3
"""What each optimizer's state costs in memory and disk traffic on the tiered runtime: the same
model, budgets and batches under every `--opt`, each in its own process (so one run's peak
RSS is not another's), against AdamW.

    python bench/optimizer_memory.py --model-size 350m --device-budget 256MiB --host-budget 1GiB

The placement is `tiered` (device, then host, then disk, within the budgets), so a smaller
state leaves less of the model on disk. Per optimizer: its state bytes per parameter, the bytes
the ledger put on each tier, the process's peak RSS over the steps (VmHWM, reset after setup),
disk bytes read and written in the last step (forward, backward and the update it waits for),
and that step's time. On a CPU-only machine the "device" is this process's RAM too.

Results: docs/results/optimizers.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 2**30


def child(args: argparse.Namespace) -> None:
    import torch

    from tierlm.config import OptimConfig, parse_bytes
    from tierlm.memory.tiers import Link, Tier
    from tierlm.models import build_model, preset_config
    from tierlm.optim import model_state_nbytes
    from tierlm.runtime import EngineOptions, build_engine

    def rss(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    cfg = preset_config(args.model_size, max_seq_len=args.seq_len)
    model = build_model(cfg, device="cpu", seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    optim = OptimConfig(name=args.child, lr=1e-4, galore_rank=args.galore_rank)
    state = model_state_nbytes(model, optim)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=".bench-optim-") as off:
        opts = EngineOptions(policy="tiered", device_budget_bytes=parse_bytes(args.device_budget),
                             host_budget_bytes=parse_bytes(args.host_budget), offload_dir=off,
                             batch_size=args.batch_size, seq_len=args.seq_len)
        eng = build_engine(model, optim, opts, device=torch.device("cpu"))
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
        g = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                                  generator=g)
            before = dict(eng.ledger.total_moved_bytes)
            t0 = time.perf_counter()
            eng.step([batch], 1e-4)
            eng.synchronize()  # the step's update too
            step_s = time.perf_counter() - t0
            after = dict(eng.ledger.total_moved_bytes)
        out = {
            "n_params": n_params, "state_bytes": state, "peak_rss": rss("VmHWM"),
            "device": eng.ledger.peak_tier_bytes[Tier.DEVICE],
            "host": eng.ledger.peak_tier_bytes[Tier.HOST],
            "disk": eng.ledger.tier_bytes(Tier.DISK),
            "read": after.get(Link.DISK_READ, 0) - before.get(Link.DISK_READ, 0),
            "write": after.get(Link.DISK_WRITE, 0) - before.get(Link.DISK_WRITE, 0),
            "step_s": step_s,
        }
        eng.close()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="350m")
    p.add_argument("--device-budget", default="256MiB")
    p.add_argument("--host-budget", default="1GiB")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--galore-rank", type=int, default=128)
    p.add_argument("--optimizers", default="AdamW,Lion,Adafactor,AdamW8bit,GaLoreAdamW")
    p.add_argument("--dir", default=".", help="where the disk tier's files go")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    names = args.optimizers.split(",")
    if names[0] != "AdamW":
        p.error("--optimizers: start with AdamW, the baseline of every ratio")
    print(f"model {args.model_size}, budgets device {args.device_budget} host "
          f"{args.host_budget}, placement tiered, {args.steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens; GaLore rank {args.galore_rank}")
    rows = {}
    for name in names:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  {name}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {name}: done ({rows[name]['step_s']:.1f} s/step)", file=sys.stderr, flush=True)
    base = rows["AdamW"]
    print()
    print("| optimizer | state B/param | device GiB | host GiB | disk GiB | peak RSS GiB "
          "(vs AdamW) | disk read + write per step GiB (vs AdamW) | step s (vs AdamW) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        moved, base_moved = r["read"] + r["write"], base["read"] + base["write"]
        print(f"| {name} | {r['state_bytes'] / r['n_params']:.2f} | {r['device'] / GiB:.2f} "
              f"| {r['host'] / GiB:.2f} | {r['disk'] / GiB:.2f} | {r['peak_rss'] / GiB:.2f} "
              f"({r['peak_rss'] / base['peak_rss']:.2f}x) | {moved / GiB:.2f} "
              f"({moved / max(1, base_moved):.2f}x) | {r['step_s']:.1f} "
              f"({r['step_s'] / base['step_s']:.2f}x) |")


if __name__ == "__main__":
    main()

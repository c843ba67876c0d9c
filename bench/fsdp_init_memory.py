#!/usr/bin/env python3
"""Host memory of starting an FSDP2 run: every rank building the whole model against ranks
other than 0 building it on the meta device and taking their shards of rank 0's weights (what
`tierlm train --backend fsdp` does).

Two processes (gloo) on this machine; each builds the preset, wraps it in `FSDPStep` and
reports its peak RSS (ru_maxrss) and its RSS once the shards are in place. Prints a table:

    python bench/fsdp_init_memory.py --model-size 350m

Results: none recorded yet; a run goes in docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket

import psutil
import torch
import torch.multiprocessing as mp

from tierlm.config import OptimConfig
from tierlm.distributed.comm import Comm
from tierlm.distributed.fsdp import FSDPStep
from tierlm.distributed.world import World
from tierlm.memory.ledger import Ledger
from tierlm.models import build_model, count_params, preset_config

GIB = 2**30


def _rank(rank: int, world_size: int, port: int, size: str, meta: bool, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World.from_env(timeout_s=300)
    before = psutil.Process().memory_info().rss
    cfg = preset_config(size)
    model = build_model(cfg, device="meta" if meta and rank else "cpu", seed=0)
    params = count_params(model)
    step = FSDPStep(model, OptimConfig(), grad_clip=1.0, device=torch.device("cpu"),
                    world=world, comm=Comm(world.size, Ledger()), precision="fp32",
                    cpu_offload=False)
    world.barrier()
    after = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, params, before, peak, after))
    del step
    world.close()


def measure(size: str, meta: bool, world_size: int = 2) -> list[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, size, meta, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = sorted(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-size", default="350m")
    args = p.parse_args()
    rows = {"every rank builds the model": measure(args.model_size, meta=False),
            "ranks > 0 on the meta device": measure(args.model_size, meta=True)}
    params = rows["every rank builds the model"][0][1]
    print(f"{args.model_size}: {params / 1e6:.0f}M params, {params * 4 / GIB:.2f} GiB in fp32; "
          "2 ranks, gloo, no CPU offload")
    print()
    print("| start | rank 0 peak RSS GiB | rank 1 peak RSS GiB | node peak (sum) GiB "
          "| rank 1 RSS after sharding GiB | node sum vs baseline |")
    print("|---|---|---|---|---|---|")
    base = None
    for name, ranks in rows.items():
        total = sum(r[3] for r in ranks)
        base = base or total
        print(f"| {name} | {ranks[0][3] / GIB:.2f} | {ranks[1][3] / GIB:.2f} | {total / GIB:.2f} "
              f"| {ranks[1][4] / GIB:.2f} | {total / base:.2f}x |")


if __name__ == "__main__":
    main()

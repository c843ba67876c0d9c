#!/usr/bin/env python3
"""The planner's 7B design point with a memory node (issue T, the bench's plan part): the plan
without a node against a node of --node-memory over 10, 25 and 100 GbE, in bf16 and fp8.

Each row is `tierlm plan` with the design point's flags (no training, no node: the planner
alone, as `tierlm plan --memory-node-memory 128GiB --net-bandwidth 25Gbit ...` plans a node
that is not there yet): the simulated step (the engine's operations on a simulated rtx4090,
the plan's prediction), tokens/s, the step over its compute bound, the bytes each step moves
to and from the SSD and the SSD bytes written per day of training, the network bytes per step
each way, and each lane's busy time in the step. The link rate is the Ethernet line rate; the
plan takes TCP's payload share of it (tierlm.plan.inputs.TCP_PAYLOAD_SHARE).

    PYTHONPATH=src python bench/memory_node_plan.py

Results: docs/results/memory-node.md.
"""

from __future__ import annotations

import argparse
import time

from tierlm.memory.placement import gib
from tierlm.plan.checks import resolve
from tierlm.plan.inputs import hardware_for, make_plan, model_config_for

LANES = (("compute", "compute"), ("h2d", "H2D"), ("d2h", "D2H"), ("disk", "disk"),
         ("cpu_update", "CPU upd"), ("cpu_adds", "CPU adds"), ("net_send", "net up"),
         ("net_recv", "net down"), ("node_cpu", "node upd"))
DAY_S = 86_400


def row(flags: dict, precision: str, link: str | None, node_memory: str) -> str:
    overrides = {**flags, "precision.mode": precision}
    if link is not None:
        overrides |= {"memory.memory_node_memory": node_memory, "memory.net_bandwidth": link}
    cfg = resolve(None, overrides)
    hw = hardware_for(cfg)
    t0 = time.perf_counter()
    p, _, train = make_plan(cfg, model_config_for(cfg), hw, precision, advise=False)
    took = time.perf_counter() - t0
    t, m = p.times_s, p.moved_bytes
    disk = m.get("disk_read", 0) + m.get("disk_write", 0)
    tb_day = m.get("disk_write", 0) * DAY_S / t["step"] / 1e12
    counts = p.tier_counts()
    remote = sum(q.remote for q in p.placements)
    where = f"{counts['device']}/{counts['host'] - remote}/{remote}/{counts['disk']}"
    lanes = " | ".join(f"{t.get(f'simulated_{key}', 0.0):.2f}" for key, _ in LANES)
    node = "none" if link is None else f"{node_memory}, {link}"
    return (f"| {precision} | {node} | {where} | {t['step']:.2f} | {p.tokens_per_s:,.0f} | "
            f"{p.step_over_bound:.2f} | {gib(disk)} | {tb_day:.1f} | "
            f"{gib(m.get('net_send', 0))} | {gib(m.get('net_recv', 0))} | {lanes} | "
            f"{'yes' if p.fits else 'no'} | {took:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-size", default="7b")
    ap.add_argument("--hardware", default="rtx4090")
    ap.add_argument("--host-memory", default="64GiB")
    ap.add_argument("--disk-budget", default="200GiB")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--grad-accum-steps", type=int, default=8)
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--node-memory", default="128GiB")
    ap.add_argument("--links", default="10GbE,25GbE,100GbE")
    a = ap.parse_args()
    flags = {"model.size": a.model_size, "memory.hardware": a.hardware,
             "memory.host_memory": a.host_memory, "memory.disk_budget": a.disk_budget,
             "train.batch_size": a.batch_size, "data.seq_len": a.seq_len,
             "train.grad_accum_steps": a.grad_accum_steps}
    print(f"{a.model_size} on {a.hardware}, host {a.host_memory}, disk {a.disk_budget}, "
          f"{a.grad_accum_steps} x {a.batch_size} x {a.seq_len} tokens a step; memory node "
          f"{a.node_memory}; lanes: busy seconds in the simulated step")
    print()
    print("| precision | node | state dev/host/node/disk | step s | tokens/s | x compute | "
          "SSD per step | SSD TB/day | net up | net down | "
          + " | ".join(name for _, name in LANES) + " | fits | plan s |")
    print("|" + " --- |" * (13 + len(LANES)))
    for precision in a.precisions.split(","):
        for link in (None, *a.links.split(",")):
            print(row(flags, precision, link, a.node_memory), flush=True)


if __name__ == "__main__":
    main()

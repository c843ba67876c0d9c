#!/usr/bin/env python3
"""Context parallel (ring attention, gloo): activation bytes per rank and step time by CP size.

Each row trains the `small` preset (random init, one row of random tokens) for `--steps` steps
at one sequence length with CP 1 (the plain reference step, one process), 2 or 4 (the CP step,
that many gloo processes forked here). Per rank it measures:

- activation bytes: the bytes of every distinct tensor (weights aside) autograd saved for the
  backward during the last step (a `saved_tensors_hooks` count, taken at pack time: with one
  micro-batch all of it is alive at the end of the forward, so it is the peak of saved
  activations; logits included);
- peak RSS growth over the last step (VmHWM, reset before it), which adds the backward's
  transients and the K/V ring buffers;
- step time (the last step; ranks share this machine's cores, so CP N on fewer than N cores is
  no faster: the ratio that matters here is the bytes).

Ratios are against CP 1 at the same length, measured in the same run.

    nice python bench/context_parallel.py --seq 1024,2048,4096,8192 --cp 1,2,4

Results: docs/results/long-context.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import torch


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SavedBytes:
    """Bytes of the distinct storages autograd saves while active, weights not counted."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.nbytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.seen:
            self.seen.add(s.data_ptr())
            self.nbytes += s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _measure(seq: int, cp: int, steps: int, rank: int) -> dict:
    from tierlm.config import OptimConfig
    from tierlm.models import build_model, preset_config
    from tierlm.runtime.reference import ReferenceStep

    torch.manual_seed(0)
    model = build_model(preset_config("small", max_seq_len=seq), seed=0)
    ref = ReferenceStep(model, OptimConfig(lr=1e-4), grad_clip=1.0, device=torch.device("cpu"))
    stepper = ref
    if cp > 1:
        from tierlm.distributed.context import ContextLayout, build_ring
        from tierlm.distributed.context_step import ContextParallelStep

        layout = ContextLayout(rank, cp, cp)
        stepper = ContextParallelStep(ref, layout, build_ring(layout))
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, model.config.vocab_size, (1, seq + 1), generator=g)
    out: dict = {}
    for i in range(steps):
        last = i == steps - 1
        saved = SavedBytes(model)
        if last:
            _reset_rss_peak()
            rss0 = _rss_peak_bytes()
        t0 = time.perf_counter()
        with saved.hooks():
            rec = stepper.step([batch], 1e-4)
        if last:
            out = {"step_s": time.perf_counter() - t0, "saved_bytes": saved.nbytes,
                   "rss_growth_bytes": _rss_peak_bytes() - rss0, "loss": rec["loss"],
                   "kv_send_bytes": rec.get("kv_send_bytes", 0)}
    return out


def _rank_main(seq, cp, steps, rank, port, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    try:
        if cp > 1:
            import datetime as dt

            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=dt.timedelta(seconds=1800))
        queue.put((rank, True, _measure(seq, cp, steps, rank)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run(seq: int, cp: int, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(seq, cp, steps, r, port, queue))
             for r in range(cp)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(cp):
        rank, ok, value = queue.get(timeout=3600)
        if not ok:
            raise RuntimeError(f"seq {seq} cp {cp} rank {rank}:\n{value}")
        results[rank] = value
    for p in procs:
        p.join()
    return [results[r] for r in range(cp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="1024,2048,4096,8192")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    mib = 2**20
    print("| seq | CP | activation MiB / rank (max) | vs CP 1 | RSS growth MiB / rank (max) "
          "| vs CP 1 | step s (max rank) | K/V sent MiB / rank | loss |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seq in (int(s) for s in args.seq.split(",")):
        base = None
        for cp in (int(c) for c in args.cp.split(",")):
            ranks = run(seq, cp, args.steps)
            act = max(r["saved_bytes"] for r in ranks)
            rss = max(r["rss_growth_bytes"] for r in ranks)
            if base is None:
                base = (act, rss)
            print(f"| {seq} | {cp} | {act / mib:.1f} | {act / base[0]:.2f} | {rss / mib:.1f} | "
                  f"{rss / base[1]:.2f} | {max(r['step_s'] for r in ranks):.2f} | "
                  f"{ranks[0]['kv_send_bytes'] / mib:.1f} | {ranks[0]['loss']:.4f} |",
                  flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Tokens/s of the tiered runtime against the reference trainer, same model, same batches.

Rows: everything resident on the device (`--offload-policy none` through the runtime), every
block streamed from host RAM (embed and head resident), everything streamed, and every segment's
state on disk in both micro-batch orders, layer-outer with its boundary activations parked in
host RAM (`--boundary-activations host`), and the same two with the planner's disk-tier options
(issue J): gradients held in host RAM (no gradient file), and the update's master and slots
read ahead during the backward, that last row also with the master/slot write-back inside the
update (before issue J's deferred write-back: the rows without a note run it behind the step,
one segment pending); the other rows run `--order`. Steps of the
reference and the runtime are interleaved so machine noise hits both alike; the table reports
median step times and the ratio runtime/reference in tokens/s. `--pipelined` times the runtime's
steps without waiting for the update behind each (as training runs; the default waits, so each
step's time holds its whole update); `--rows REGEX` runs the rows whose label matches.

    python bench/runtime_overhead.py --model-size small --batch-size 8 --seq-len 256 --steps 6

Results: docs/results/engine-step.md.
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import tempfile
import time

import torch

from tierlm.config import ActivationConfig, OptimConfig
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.models import build_model, preset_config
from tierlm.models.adapters import ModelAdapter
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.writeback import WriteBack

FULL = ActivationConfig(policy="full")
HOST_GRADS = SegmentPlacement(False, Tier.DISK, Tier.HOST)  # times the segment count
AHEAD = ReadAhead(extra_bytes=2**40)  # every disk-tier segment read ahead
ROWS = [
    ("all resident", dict(policy="none")),
    ("blocks streamed from host", dict(policy="host", resident="embed|head")),
    ("everything streamed from host", dict(policy="host")),
    ("state on disk, microbatch-outer", dict(policy="disk", microbatch_order="microbatch-outer",
                                             activations=ActivationConfig(policy="full"))),
    ("state on disk, layer-outer, boundaries on host",
     dict(policy="disk", microbatch_order="layer-outer", boundary_tier=Tier.HOST,
          activations=ActivationConfig(policy="full"))),
    ("state on disk, microbatch-outer, gradients on host",
     dict(policy="disk", microbatch_order="microbatch-outer", placements=HOST_GRADS,
          activations=FULL)),
    ("state on disk, microbatch-outer, read-ahead",
     dict(policy="disk", microbatch_order="microbatch-outer", readahead=AHEAD,
          activations=FULL)),
    ("state on disk, layer-outer, boundaries on host, gradients on host + read-ahead",
     dict(policy="disk", microbatch_order="layer-outer", boundary_tier=Tier.HOST,
          placements=HOST_GRADS, readahead=AHEAD, activations=FULL)),
    ("state on disk, layer-outer, boundaries on host, gradients on host + read-ahead, "
     "write-back inside the update",
     dict(policy="disk", microbatch_order="layer-outer", boundary_tier=Tier.HOST,
          placements=HOST_GRADS, readahead=AHEAD, activations=FULL, writeback=None)),
    ("state on disk, layer-outer, boundaries on host, gradients on host + read-ahead, "
     "every write-back behind the step",
     dict(policy="disk", microbatch_order="layer-outer", boundary_tier=Tier.HOST,
          placements=HOST_GRADS, readahead=AHEAD, activations=FULL,
          writeback=WriteBack(segments=1000))),
]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--order", default="microbatch-outer")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", default="", help="regex: run only the rows whose label matches")
    p.add_argument("--pipelined", action="store_true",
                   help="do not wait for each step's update before timing the next step")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config(args.model_size, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    base = build_model(cfg, device="cpu", seed=0)
    optim = OptimConfig(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [
        [torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
         for _ in range(args.micro_batches)]
        for _ in range(args.warmup + args.steps)
    ]
    tokens = args.batch_size * args.seq_len * args.micro_batches
    print(f"torch {torch.__version__} on {device}, threads {torch.get_num_threads()}; "
          f"model {args.model_size}; {args.micro_batches} x ({args.batch_size} x "
          f"{args.seq_len}) tokens per step; {args.steps} timed steps after {args.warmup}")

    ref_model = copy.deepcopy(base).to(device)
    ref = ReferenceStep(ref_model, optim, grad_clip=1.0, device=device)
    rows = []
    n_segs = len(ModelAdapter(base).segments)
    with tempfile.TemporaryDirectory() as off:
        for label, kw in ROWS:
            if not re.search(args.rows, label):
                continue
            if "placements" in kw:
                kw = {**kw, "placements": [kw["placements"]] * n_segs}
            eng = build_engine(
                copy.deepcopy(base), optim,
                EngineOptions(offload_dir=off, batch_size=args.batch_size, seq_len=args.seq_len,
                              micro_batches=args.micro_batches,
                              **{"microbatch_order": args.order, **kw}),
                device=device,
            )
            ref_t, eng_t = [], []
            for i, b in enumerate(batches):
                rt = timed(lambda b=b: ref.step(b, 1e-4))
                et = timed(lambda b=b, e=eng: (e.step(b, 1e-4),
                                               None if args.pipelined else e.synchronize()))
                if i >= args.warmup:
                    ref_t.append(rt)
                    eng_t.append(et)
            eng.synchronize()
            moved = {link: n / 2**20 for link, n in eng.ledger.moved_bytes.items()}
            rows.append((label, statistics.median(ref_t), statistics.median(eng_t),
                         *(moved.get(k, 0.0) for k in ("h2d", "d2h", "disk_read", "disk_write"))))
            eng.close()

    print()
    print("| runtime placement | reference step (s) | runtime step (s) | reference tok/s "
          "| runtime tok/s | runtime / reference | H2D MiB/step | D2H MiB/step "
          "| disk read MiB/step | disk write MiB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, rt, et, h2d, d2h, dr, dw in rows:
        print(f"| {label} | {rt:.3f} | {et:.3f} | {tokens / rt:,.0f} | {tokens / et:,.0f} "
              f"| {rt / et:.3f} | {h2d:.1f} | {d2h:.1f} | {dr:.1f} | {dw:.1f} |")


if __name__ == "__main__":
    main()

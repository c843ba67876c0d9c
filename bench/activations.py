#!/usr/bin/env python3
"""Activation memory and step time per activation policy, and `dynamic` under three budgets.

Table 1: one engine, everything resident (`--offload-policy none`), each step run under one
policy, the policies interleaved round by round so machine noise hits them alike. Columns: the
ledger's peak of activations on the device (boundary inputs + saved tensors + workspace), the
bytes offloaded to the host, the peak resident memory the step adds over its start (real memory:
on a CPU-only machine the "device" is RAM), and the median step time; ratios against `keep`.

Table 2: `--grad-checkpointing dynamic` with device budgets between its minimum (every block
recomputed) and what keeping everything needs, one engine per budget. It keeps the last blocks
first and recomputes more as the budget shrinks; the ledger's device peak (model state +
boundary + saved + workspace) is checked against each budget.

With CUDA the same tables come from the GPU, and a `max_memory_allocated` column is added.

    python bench/activations.py --model-size 125m --seq-len 1024 --batch-size 1
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import statistics
import time

import torch

from tierlm.activations import activation_peak_bytes
from tierlm.config import ActivationConfig, OptimConfig
from tierlm.memory.tiers import Tier
from tierlm.models import build_model, preset_config
from tierlm.runtime import Engine, EngineOptions

POLICIES = ("keep", "selective", "full", "offload")
MiB = 2**20


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak memory a step adds over its start: `max_memory_allocated` on CUDA, VmHWM on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.base = _status_bytes("VmRSS:")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _status_bytes("VmHWM:") - self.base


def measured_step(eng: Engine, batch, device) -> dict:
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        eng.step(batch, 1e-4)
        eng.synchronize()
        seconds = time.perf_counter() - t0
    snap = eng.ledger.snapshot()
    return {
        "s": seconds,
        "act": snap["activation_step_peak_bytes"],
        "offloaded": snap["offloaded_activation_step_peak_bytes"],
        "device_total": eng.ledger.step_peak_device_total_bytes,
        "real": mem.peak,
    }


def options(args, **kw) -> EngineOptions:
    return EngineOptions(policy="none", batch_size=args.batch_size, seq_len=args.seq_len, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="125m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--fractions", default="1.0,0.5,0.1",
                   help="dynamic budgets: share of keep's extra activation need granted")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config(args.model_size, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    base = build_model(cfg, device="cpu", seed=0)
    optim = OptimConfig(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    rounds = args.warmup + args.steps
    batches = [[torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1),
                              generator=g)] for _ in range(rounds)]
    n_params = sum(p.numel() for p in base.parameters())
    memory = "max_memory_allocated" if device.type == "cuda" else "peak RSS increase"
    print(f"torch {torch.__version__} on {device}, threads {torch.get_num_threads()}; model "
          f"{args.model_size} ({n_params / 1e6:.0f}M params, vocab {args.vocab_size}); batch "
          f"{args.batch_size} x seq {args.seq_len}, fp32; {args.steps} timed steps after "
          f"{args.warmup} per row; real memory = {memory} over the step's start")

    # -- table 1: the fixed policies, interleaved in one engine ----
    eng = Engine(copy.deepcopy(base), optim, options(args), device=device)
    n = len(eng.states) - 1
    rows: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for r in range(rounds):
        for name in POLICIES:
            eng.set_activation_policies([name] * n)
            rec = measured_step(eng, batches[r], device)
            if r >= args.warmup:
                rows[name].append(rec)
    state_bytes = eng.report.device_bytes - eng.activation_bytes  # model state on the device
    eng.close()
    del eng
    gc.collect()

    def med(name: str, key: str) -> float:
        return statistics.median(rec[key] for rec in rows[name])

    keep = {k: med("keep", k) for k in ("s", "act", "real")}
    print()
    print("| policy | peak activations on device (ledger) | vs keep | offloaded to host "
          f"| {memory} | vs keep | step time (s) | vs keep |")
    print("|---|---|---|---|---|---|---|---|")
    for name in POLICIES:
        act, real, s = med(name, "act"), med(name, "real"), med(name, "s")
        print(f"| {name} | {act / MiB:,.1f} MiB | {act / keep['act']:.2f} | "
              f"{med(name, 'offloaded') / MiB:,.1f} MiB | {real / MiB:,.1f} MiB | "
              f"{real / keep['real']:.2f} | {s:.2f} | {s / keep['s']:.2f} |")

    # -- table 2: dynamic under three budgets ----
    dyn = ActivationConfig(policy="dynamic")
    probe = Engine(copy.deepcopy(base), optim, options(args, activations=dyn), device=device)
    costs, reserve = probe.activation_costs, probe.activation_reserve_bytes
    fixed = probe.report.device_bytes - reserve  # model state + boundary activations
    keep_need = activation_peak_bytes(
        ["keep"] * n, costs, in_flight=1, head_bytes=probe.activation_head_bytes
    )
    probe.close()
    del probe
    gc.collect()
    # budgets between dynamic's minimum (everything recomputed) and keeping everything
    budgets = [
        fixed + reserve + int(float(f) * (keep_need - reserve))
        for f in args.fractions.split(",")
    ]
    print()
    print(f"model state on the device {state_bytes / MiB:,.0f} MiB; dynamic's minimum "
          f"activation reserve {reserve / MiB:,.0f} MiB; keeping every block needs "
          f"{keep_need / MiB:,.0f} MiB (predicted)")
    print()
    print("| device budget | for activations | chosen per segment (embed, blocks) "
          "| keep / selective / full | ledger device peak | inside budget "
          f"| {memory} | step time (s) | vs keep |")
    print("|---|---|---|---|---|---|---|---|---|")
    for budget in budgets:
        eng = Engine(copy.deepcopy(base), optim,
                     options(args, activations=dyn, device_budget_bytes=budget), device=device)
        chosen = eng.activation_policies
        recs = [measured_step(eng, batches[r], device) for r in range(rounds)][args.warmup:]
        peak = max(rec["device_total"] for rec in recs)
        assert eng.ledger.step_peak_tier_bytes[Tier.DEVICE] <= budget
        s = statistics.median(rec["s"] for rec in recs)
        real = statistics.median(rec["real"] for rec in recs)
        short = "".join({"keep": "K", "selective": "S", "full": "F", "offload": "O"}[c]
                        for c in chosen)
        counts = "/".join(str(chosen.count(c)) for c in ("keep", "selective", "full"))
        print(f"| {budget / MiB:,.0f} MiB | {(budget - fixed) / MiB:,.0f} MiB | {short} | "
              f"{counts} | {peak / MiB:,.0f} MiB | {'yes' if peak <= budget else 'NO'} | "
              f"{real / MiB:,.0f} MiB | {s:.2f} | {s / keep['s']:.2f} |")
        eng.close()
        del eng
        gc.collect()


if __name__ == "__main__":
    main()

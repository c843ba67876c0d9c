#!/usr/bin/env python3
"""Activation memory and step time per activation policy, and `dynamic` under three budgets.

Table 1: one engine, everything resident (`--offload-policy none`), each step run under one
policy, the policies interleaved round by round so machine noise hits them alike. Columns: the
ledger's peak of activations on the device (boundary inputs + saved tensors + workspace), the
bytes offloaded to the host, the peak resident memory the step adds over its start (real memory:
on a CPU-only machine the "device" is RAM), and the step's CPU time (all threads of this
process: the work done, steady on a shared machine) and wall time, each the best of the timed
steps (noise only adds); ratios against `keep`.

Table 2: `--grad-checkpointing dynamic` with device budgets between its minimum (every block
recomputed) and what keeping everything needs. Each budget's choice comes from an engine built
with that budget (as `tierlm train --grad-checkpointing dynamic --device-budget ...` builds
it); the choices then run interleaved with table 1's rows in the same engine, so their step
times compare with `keep` under the same machine noise. It keeps the last blocks first and
recomputes more as the budget shrinks; the ledger's device peak (model state + boundary +
saved + workspace) is checked against each budget.

With CUDA the same tables come from the GPU, and a `max_memory_allocated` column is added.

    python bench/activations.py --model-size 125m --seq-len 1024 --batch-size 1

Results: none recorded yet; a run goes in docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import time

import torch

from tierlm.activations import activation_peak_bytes
from tierlm.config import ActivationConfig, OptimConfig
from tierlm.models import build_model, preset_config
from tierlm.runtime import Engine, EngineOptions, build_engine

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


def timed_step(eng: Engine, batch) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    eng.step(batch, 1e-4)
    eng.synchronize()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    snap = eng.ledger.snapshot()
    return {
        "s": seconds,
        "cpu_s": cpu_seconds,
        "act": snap["activation_step_peak_bytes"],
        "offloaded": snap["offloaded_activation_step_peak_bytes"],
        "device_total": eng.ledger.step_peak_device_total_bytes,
    }


def memory_step(eng: Engine, batch, device) -> int:
    """A step of its own for real memory: trimming the allocator first would put page faults
    into a timed step."""
    with PeakMemory(device) as mem:
        eng.step(batch, 1e-4)
        eng.synchronize()
    return mem.peak


def options(args, **kw) -> EngineOptions:
    return EngineOptions(policy="none", batch_size=args.batch_size, seq_len=args.seq_len, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="125m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
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
          f"{args.warmup} per row (time: best of them); real memory = {memory} over the "
          "step's start")

    # -- dynamic's choices: one engine per budget, built as `tierlm train` builds it ----
    dyn = ActivationConfig(policy="dynamic")
    probe = build_engine(copy.deepcopy(base), optim, options(args, activations=dyn), device=device)
    n = len(probe.states) - 1
    reserve = probe.activation_reserve_bytes  # dynamic's minimum (every block recomputed)
    fixed = probe.report.device_bytes - reserve  # model state + boundary activations
    keep_need = activation_peak_bytes(
        ["keep"] * n, probe.activation_costs, in_flight=1, head_bytes=probe.activation_head_bytes
    )
    probe.close()
    del probe
    budgets = [fixed + reserve + int(float(f) * (keep_need - reserve))
               for f in args.fractions.split(",")]
    chosen = []
    for budget in budgets:
        eng = build_engine(copy.deepcopy(base), optim,
                           options(args, activations=dyn, device_budget_bytes=budget),
                           device=device)
        chosen.append(list(eng.activation_policies))
        eng.close()
        del eng
        gc.collect()

    # -- every row in one engine, interleaved round by round ----
    eng = build_engine(copy.deepcopy(base), optim, options(args), device=device)
    state_bytes = eng.report.device_bytes - eng.activation_bytes
    rows = {name: [name] * n for name in POLICIES}
    rows.update({f"dynamic {i}": c for i, c in enumerate(chosen)})
    recs: dict[str, list[dict]] = {row: [] for row in rows}
    real_bytes: dict[str, int] = {}
    for r in range(rounds + 1):
        for row, names in rows.items():
            eng.set_activation_policies(names)
            if r == rounds:
                real_bytes[row] = memory_step(eng, batches[0], device)
                continue
            rec = timed_step(eng, batches[r])
            if r >= args.warmup:
                recs[row].append(rec)
    eng.close()

    def med(row: str, key: str) -> float:
        """Times: the best of the timed steps (the machine is shared; noise only adds).
        Memory: the largest peak."""
        if key == "real":
            return real_bytes[row]
        pick = min if key in ("s", "cpu_s") else max
        return pick(rec[key] for rec in recs[row])

    keep = {k: med("keep", k) for k in ("s", "cpu_s", "act", "real")}

    def times(row: str) -> str:
        s, cpu = med(row, "s"), med(row, "cpu_s")
        return f"{cpu:.2f} | {cpu / keep['cpu_s']:.2f} | {s:.2f} | {s / keep['s']:.2f}"

    print()
    print("| policy | peak activations on device (ledger) | vs keep | offloaded to host "
          f"| {memory} | vs keep | step CPU time (s) | vs keep | step wall time (s) "
          "| vs keep |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in POLICIES:
        act, real = med(name, "act"), med(name, "real")
        print(f"| {name} | {act / MiB:,.1f} MiB | {act / keep['act']:.2f} | "
              f"{med(name, 'offloaded') / MiB:,.1f} MiB | {real / MiB:,.1f} MiB | "
              f"{real / keep['real']:.2f} | {times(name)} |")

    print()
    print(f"model state on the device {state_bytes / MiB:,.0f} MiB, with the boundary "
          f"activations' reserve {fixed / MiB:,.0f} MiB; dynamic's minimum activation reserve "
          f"{reserve / MiB:,.0f} MiB; keeping every block needs {keep_need / MiB:,.0f} MiB "
          "(predicted)")
    print()
    print("| device budget | for activations | chosen (embed, blocks: Keep/Selective/Full) "
          "| keep / selective / full | ledger device peak | inside budget "
          f"| {memory} | step CPU time (s) | vs keep | step wall time (s) | vs keep |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, budget in enumerate(budgets):
        row, names = f"dynamic {i}", chosen[i]
        peak = max(rec["device_total"] for rec in recs[row])
        short = "".join({"keep": "K", "selective": "S", "full": "F", "offload": "O"}[c]
                        for c in names)
        counts = "/".join(str(names.count(c)) for c in ("keep", "selective", "full"))
        print(f"| {budget / MiB:,.0f} MiB | {(budget - fixed) / MiB:,.0f} MiB | {short} | "
              f"{counts} | {peak / MiB:,.0f} MiB | {'yes' if peak <= budget else 'NO'} | "
              f"{med(row, 'real') / MiB:,.0f} MiB | {times(row)} |")


if __name__ == "__main__":
    main()

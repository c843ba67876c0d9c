#!/usr/bin/env python3
"""`--compile segments` against eager: step speed, peak memory and the compile time, per preset.

For each model size and runtime (`resident`: the reference trainer, the whole model on the
device; `host`: the tiered runtime with every block streamed from host RAM and recomputed in
the backward) an eager and a compiled stepper are built from the same weights and run the same
batches, their steps interleaved (eager, compiled, eager, ...) so machine noise hits both alike.
The first step of each is reported apart: the compiled one includes compiling the block and the
head's chunk loss (`cache`: whether the inductor cache dir held anything when the bench started;
the rows share it, so a later row may find kernels an earlier one built). The timed steps give the
best wall time (noise only adds), tokens/s from it, the best CPU time of this process (all
threads), the peak resident memory a step adds over its start (VmHWM after a reset; on a GPU:
max_memory_allocated), and the largest loss difference between the two (same batches).
`--precision bf16`: both steppers compute in bf16 (tierlm.precision's layers under bf16
autocast; the host runtime streams bf16 compute copies), as `--precision auto` does on a GPU.
`--finetune lora`: peft's LoRA adapters (rank 16 on every linear of the blocks) on a frozen base,
as `--finetune lora` trains them (the host runtime streams the frozen base; under bf16 its bf16
copy).

    python bench/compile.py --sizes small 125m --steps 4 --seq-len 256 --batch-size 4

Results: docs/results/compile.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import torch
from activations import PeakMemory  # bench/activations.py, this script's folder

from tierlm.config import ActivationConfig, LoraConfig, OptimConfig, PrecisionConfig
from tierlm.finetune.lora import apply_lora, store_frozen_as_computed
from tierlm.models import build_model, preset_config
from tierlm.precision import prepare_precision
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.compile import NoCompile, SegmentCompile, compiled_graphs
from tierlm.runtime.reference import ReferenceStep

OPTIM = OptimConfig(lr=1e-4, weight_decay=0.1)
MiB = 2**20


def build(base, runtime: str, compiled, device, args):
    model = copy.deepcopy(base)
    autocast = {}
    if args.precision == "bf16":
        prepare_precision(model, PrecisionConfig(mode="bf16"), "bf16", device, log=lambda m: None)
        if args.finetune == "lora":  # the frozen base held as its bf16 layers read it
            store_frozen_as_computed(model)
        autocast = {"autocast": lambda: torch.autocast(device.type, dtype=torch.bfloat16)}
    compiled.apply(model, lambda msg: None)
    if runtime == "resident":
        return ReferenceStep(model.to(device), OPTIM, grad_clip=1.0, device=device, **autocast)
    lora = args.finetune == "lora"
    base_format = ("bf16" if args.precision == "bf16" else "fp32") if lora else "fp32"
    opts = EngineOptions(policy="host", batch_size=args.batch_size, seq_len=args.seq_len,
                         activations=ActivationConfig(policy="full"), base_format=base_format,
                         chunk_loss=compiled.chunk_loss,
                         offload_dir=tempfile.mkdtemp(prefix="tierlm-bench-compile-"), **autocast)
    return build_engine(model, OPTIM, opts, device=device)


def step(stepper, batch, device) -> dict:
    with PeakMemory(device) as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        rec = stepper.step(batch, OPTIM.lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"loss": rec["loss"], "wall_s": wall, "cpu_s": cpu, "peak": mem.peak}


def bench(size: str, runtime: str, args, device, compiler: SegmentCompile, warm: bool) -> list:
    cfg = preset_config(size, max_seq_len=args.seq_len)
    base = build_model(cfg, device="cpu", seed=0)
    if args.finetune == "lora":
        apply_lora(base, LoraConfig(rank=16, alpha=32.0), seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                              generator=g)] for _ in range(args.steps + 1)]
    tokens = args.batch_size * args.seq_len
    recs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    steppers = {"eager": build(base, runtime, NoCompile(), device, args),
                "compiled": build(base, runtime, compiler, device, args)}
    del base
    graphs0 = compiled_graphs()
    for b in batches:
        for name in ("eager", "compiled"):
            recs[name].append(step(steppers[name], b, device))
    graphs = compiled_graphs() - graphs0
    for s in steppers.values():
        if hasattr(s, "close"):
            s.close()
    loss_diff = max(abs(e["loss"] - c["loss"]) / abs(e["loss"])
                    for e, c in zip(recs["eager"], recs["compiled"], strict=True))
    rows = []
    eager_best = min(r["wall_s"] for r in recs["eager"][1:])
    for name in ("eager", "compiled"):
        first, timed = recs[name][0], recs[name][1:]
        best = min(r["wall_s"] for r in timed)
        rows.append({
            "size": size, "runtime": runtime if args.finetune == "full" else
            f"{runtime}, {args.finetune}", "mode": name,
            "first_s": first["wall_s"],
            "compile_s": first["wall_s"] - best if name == "compiled" else None,
            "cache": ("warm" if warm else "cold") if name == "compiled" else "",
            "wall_s": best, "tok_s": tokens / best,
            "cpu_s": min(r["cpu_s"] for r in timed),
            "peak": max(r["peak"] for r in timed),
            "speedup": eager_best / best,
            "graphs": graphs if name == "compiled" else None,
            "loss_rel": loss_diff if name == "compiled" else None,
        })
    return rows


def table(rows: list[dict]) -> str:
    head = ("| size | runtime | mode | first step s | compile s (cache) | best step s | tokens/s "
            "| CPU s | step peak RSS MiB | speed vs eager | graphs | loss rel diff |")
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        compile_s = f"{r['compile_s']:.1f} ({r['cache']})" if r["compile_s"] is not None else "-"
        loss_rel = "-" if r["loss_rel"] is None else f"{r['loss_rel']:.1e}"
        lines.append(
            f"| {r['size']} | {r['runtime']} | {r['mode']} | {r['first_s']:.2f} | {compile_s} "
            f"| {r['wall_s']:.3f} | {r['tok_s']:.0f} | {r['cpu_s']:.2f} | {r['peak'] / MiB:.0f} "
            f"| {r['speedup']:.2f}x | {r['graphs'] if r['graphs'] is not None else '-'} "
            f"| {loss_rel} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "125m"])
    ap.add_argument("--runtimes", nargs="+", default=["resident", "host"],
                    choices=["resident", "host"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps after the first")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--finetune", default="full", choices=["full", "lora"])
    ap.add_argument("--cache-dir", default=None,
                    help="inductor cache (default: a fresh one, so the first compile is cold)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="tierlm-bench-inductor-"))
    warm = cache.exists() and any(cache.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    compiler = SegmentCompile(cache, precision=args.precision)
    rows = []
    for size in args.sizes:
        for runtime in args.runtimes:
            rows += bench(size, runtime, args, device, compiler, warm)
            print(table(rows[-2:]), flush=True)
    print(f"\n{args.precision}, --finetune {args.finetune}, seq {args.seq_len}, batch "
          f"{args.batch_size}, {args.steps} timed steps, device "
          f"{device}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(table(rows))


if __name__ == "__main__":
    main()

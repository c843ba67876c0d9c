#!/usr/bin/env python3
"""Liger Kernel against eager and `--compile segments` on one block and the head (GPU only).

Issue O item 2: Liger's fused RMSNorm, SwiGLU and RoPE (Triton kernels patched into the
transformers Llama modules) and its fused linear cross-entropy (the output projection and the
loss in chunks, logits never whole) against the eager block with tierlm's chunked
cross-entropy, and against the compiled block with the compiled chunk loss
(tierlm.runtime.compile). One `1b` decoder block plus the head (final norm, projection, loss),
weights in bf16, batch x seq tokens per step; every mode starts from the same weights and
trains on the same batches (no optimizer: forward+backward only, gradients zeroed between
steps). Reported per mode: tokens/s over the timed steps (best and median step), peak
`max_memory_allocated` and `memory_reserved` over them, allocator retries, and against eager
the first step's loss and the block's gradient (relative difference).

    python bench/gpu_liger.py --size 1b --seq-len 2048 --batch-size 1 --steps 20

Needs CUDA and `pip install liger-kernel` (Triton); on a CPU it says so and exits with 2.

Results: none recorded yet; a run goes in docs/results/compile.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.activations.chunked_loss import (
    chunked_cross_entropy,
    default_chunk_tokens,
    sum_cross_entropy,
)
from tierlm.models import build_model, preset_config
from tierlm.runtime.compile import SegmentCompile

MODES = ("eager", "compiled", "liger")


def _needs() -> str | None:
    if not torch.cuda.is_available():
        return "bench/gpu_liger.py: no CUDA device; Liger's kernels are Triton (CUDA) only"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "bench/gpu_liger.py: liger_kernel is not importable; pip install liger-kernel"
    return None


def build(base, mode: str, cache: Path):
    """The model for `mode` and its loss step: (ids, targets) -> loss float (backward done)."""
    model = copy.deepcopy(base)
    chunk = default_chunk_tokens(model.config.vocab_size)
    loss_of = sum_cross_entropy
    if mode == "compiled":
        compiler = SegmentCompile(cache, precision="bf16")
        compiler.apply(model, lambda m: None)
        loss_of = compiler.chunk_loss
    if mode == "liger":
        from liger_kernel.transformers import (
            LigerFusedLinearCrossEntropyLoss,
            apply_liger_kernel_to_llama,
        )

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
        fused = LigerFusedLinearCrossEntropyLoss()

        def step(ids: torch.Tensor, targets: torch.Tensor) -> float:
            h = model.model(input_ids=ids).last_hidden_state  # (B, T, D), final norm applied
            loss = fused(model.lm_head.weight, h.reshape(-1, h.shape[-1]), targets.reshape(-1))
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
            return loss.item()

        return model, step

    def step(ids: torch.Tensor, targets: torch.Tensor) -> float:
        h = model.model(input_ids=ids).last_hidden_state
        return chunked_cross_entropy(model.lm_head, h.reshape(-1, h.shape[-1]),
                                     targets.reshape(-1), chunk_tokens=chunk,
                                     loss_of=loss_of).item()

    return model, step


def run(base, mode: str, batches, warmup: int, cache: Path) -> dict:
    model, step = build(base, mode, cache)
    block = model.model.layers[0]
    first_loss, grad = None, None
    times = []
    retries0 = 0
    for i, (ids, targets) in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(ids, targets)
        torch.cuda.synchronize()
        if i == 0:
            first_loss = loss
            grad = torch.cat([p.grad.float().flatten() for p in block.parameters()])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    tokens = batches[0][0].numel()
    return {"mode": mode, "best_s": min(times), "median_s": statistics.median(times),
            "tok_s": tokens / statistics.median(times),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "retries": retries, "loss": first_loss, "grad": grad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compiling)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    missing = _needs()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg = preset_config(args.size, max_seq_len=args.seq_len)
    cfg.num_hidden_layers = 1
    base = build_model(cfg, device=dev, dtype=torch.bfloat16, seed=0)
    g = torch.Generator(device=dev).manual_seed(0)
    batches = []
    for _ in range(args.warmup + args.steps):
        row = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=dev,
                            generator=g)
        batches.append((row[:, :-1], row[:, 1:]))
    cache = Path(tempfile.mkdtemp(prefix="tierlm-bench-liger-inductor-"))
    rows = [run(base, mode, batches, args.warmup, cache) for mode in args.modes]
    ref = rows[0]
    print(f"one {args.size} block + head, bf16 weights, {args.batch_size} x {args.seq_len} "
          f"tokens, {args.steps} timed steps after {args.warmup}, "
          f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"| mode | tokens/s (median) | best step ms | max allocated GiB | max reserved GiB "
          f"| alloc retries | loss rel vs {ref['mode']} | block grad rel vs {ref['mode']} |")
    print("|" + " --- |" * 8)
    for r in rows:
        grad_rel = ((r["grad"] - ref["grad"]).norm() / ref["grad"].norm()).item()
        print(f"| {r['mode']} | {r['tok_s']:,.0f} | {r['best_s'] * 1e3:.1f} "
              f"| {r['max_allocated'] / 2**30:.2f} | {r['max_reserved'] / 2**30:.2f} "
              f"| {r['retries']} | {abs(r['loss'] - ref['loss']) / abs(ref['loss']):.1e} "
              f"| {grad_rel:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""fp8 matmul throughput against bf16 (and fp32) for given layer shapes, plus the whole fp8
linear layer (quantise, matmul, statistics; forward and backward) against a bf16 one.

    python bench/fp8_matmul.py                          # 7B layer shapes (CUDA) or smaller (CPU)
    python bench/fp8_matmul.py --shapes 4096x4096,4096x11008 --tokens 8192

On CUDA sm_89+ the fp8 column is `torch._scaled_mm` (the kernel tierlm uses there); on the CPU
both torch's `_scaled_mm` and tierlm's emulation are shown (tierlm picks the emulation on the
CPU: the same numbers without the CPU's slow fp8 conversions). Ratios are against bf16
measured in the same run.

Results: none recorded yet; the first run starts docs/results/precision.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tierlm.precision.formats import E4M3
from tierlm.precision.linear import Fp8LayerScalers, Fp8Linear
from tierlm.precision.matmul import Emulated, ScaledMM, scaled_mm_works
from tierlm.precision.scaling import DynamicScaling


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--shapes", default=None,
                   help="comma-separated in x out (default: 4096x4096,4096x11008 on CUDA, "
                   "384x1024,1024x384 on the CPU)")
    p.add_argument("--tokens", type=int, default=None, help="rows of the activation (M)")
    p.add_argument("--repeat", type=int, default=None)
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    shapes = args.shapes or ("4096x4096,4096x11008" if cuda else "384x1024,1024x384")
    tokens = args.tokens or (8192 if cuda else 1024)
    repeat = args.repeat or (20 if cuda else 3)
    kernels = {"scaled_mm": ScaledMM()} if scaled_mm_works(device) else {}
    if not cuda:
        kernels["emulated"] = Emulated()
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"torch {torch.__version__}, {name}, threads {torch.get_num_threads()}, "
          f"M = {tokens} tokens, median of {repeat}")
    print()
    print("| shape (in x out) | op | fp32 | bf16 | " + " | ".join(f"fp8 {k}" for k in kernels)
          + " | fp8 speed-up over bf16 |")
    print("|---|---|---|---|" + "---|" * len(kernels) + "---|")
    for shape in shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        measure(device, tokens, k, n, kernels, repeat)


def measure(device: torch.device, tokens: int, k: int, n: int, kernels: dict, repeat: int):
    x = torch.randn(tokens, k, device=device)
    w = torch.randn(n, k, device=device) * 0.02
    gout = torch.randn(tokens, n, device=device) * 1e-3
    flops = 2 * tokens * k * n

    # the matmul alone: TFLOP/s
    xb, wb = x.bfloat16(), w.bfloat16()
    row = {"fp32": flops / timed(lambda: x @ w.t(), device, repeat),
           "bf16": flops / timed(lambda: xb @ wb.t(), device, repeat)}
    one = torch.ones((), device=device)
    for kname, kernel in kernels.items():
        xk, wk = kernel.cast(x.clamp(-448, 448), E4M3), kernel.cast(w, E4M3)
        row[kname] = flops / timed(
            lambda kernel=kernel, xk=xk, wk=wk: kernel(xk, wk.t(), one, one, torch.bfloat16),
            device, repeat)
    best = max(row[c] for c in kernels)
    print(f"| {k}x{n} | matmul, TFLOP/s | " + " | ".join(
        f"{row[c] / 1e12:.3f}" for c in ("fp32", "bf16", *kernels)) +
        f" | {best / row['bf16']:.2f}x |")

    # the whole layer, forward + backward: ms
    def layer(compute, dtype=None):
        xs = (x if dtype is None else x.to(dtype)).detach().requires_grad_()
        ws = w.detach().requires_grad_()
        out = compute(xs, ws)
        out.backward(gout.to(out.dtype))

    def bf16_linear(xs, ws):
        return F.linear(xs, ws.bfloat16())

    ms = {"fp32": timed(lambda: layer(F.linear), device, repeat),
          "bf16": timed(lambda: layer(bf16_linear, torch.bfloat16), device, repeat)}
    for kname, kernel in kernels.items():
        fp8 = Fp8Linear(Fp8LayerScalers("l", DynamicScaling(), DynamicScaling()), kernel)

        def run(fp8=fp8):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                layer(lambda xs, ws: fp8(xs, ws, None))

        ms[kname] = timed(run, device, repeat)
    best = min(ms[c] for c in kernels)
    print(f"| {k}x{n} | layer fwd+bwd, ms | " + " | ".join(
        f"{ms[c] * 1e3:.1f}" for c in ("fp32", "bf16", *kernels)) +
        f" | {ms['bf16'] / best:.2f}x |")

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Which 8-bit maps keep AdamW's moments closest to fp32: the error after 20 steps of a gradient
stream whose scale varies by orders of magnitude within a block, per map pair, blockwise
(256) absmax scaling throughout. Usage:

    python bench/optimizer_maps.py [--numel 1048576] [--steps 20]

Columns: the relative L2 error of the dequantised first and second moments after the last
step, and of that step's Adam update m_hat / (sqrt(v_hat) + eps), against fp32 AdamW on the same
stream; and the 95th percentile of the elementwise relative update error. The update reads the
step's fp32 moments (as torchao, bitsandbytes and tierlm's AdamW8bit do), advanced from the
stored ones, so it carries the error the 8-bit history left.

Results: none recorded yet; a run goes in docs/results/optimizers.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

BLOCK = 256


def dynamic_map(signed: bool) -> torch.Tensor:
    """The dynamic-tree map of bitsandbytes/torchao (Dettmers 2015), rebuilt: 7 exponent
    decades, linear fractions within each; 256 sorted values with 0 and 1."""
    data = []
    non_sign_bits = 7
    for i in range(7):
        items = 2 ** (i + non_sign_bits - 7) + 1 if signed else 2 ** (i + non_sign_bits - 6) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2
        data += (10 ** (-6 + i) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def table_codec(table: torch.Tensor) -> tuple[Callable, Callable]:
    mids = (table[1:] + table[:-1]) / 2

    def enc(x: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(mids, x.contiguous())

    def dec(q: torch.Tensor) -> torch.Tensor:
        return table[q]

    return enc, dec


def power_codec(levels: int, power: float, signed: bool) -> tuple[Callable, Callable]:
    def enc(x: torch.Tensor) -> torch.Tensor:
        c = x.abs().pow(1 / power) * levels
        return (torch.copysign(c, x) if signed else c).round()

    def dec(q: torch.Tensor) -> torch.Tensor:
        if signed:
            return torch.copysign((q.abs() / levels).pow(power), q)
        return (q / levels).pow(power)

    return enc, dec


M_MAPS = {
    "linear": power_codec(127, 1.0, True),
    "power 2": power_codec(127, 2.0, True),
    "power 3": power_codec(127, 3.0, True),
    "power 4": power_codec(127, 4.0, True),
    "dynamic tree": table_codec(dynamic_map(True)),
}
V_MAPS = {
    "linear": power_codec(255, 1.0, False),
    "linear in sqrt(v)": power_codec(255, 2.0, False),
    "power 4": power_codec(255, 4.0, False),
    "power 6": power_codec(255, 6.0, False),
    "dynamic tree": table_codec(dynamic_map(False)),
}


def roundtrip(x: torch.Tensor, codec: tuple[Callable, Callable]) -> torch.Tensor:
    enc, dec = codec
    xb = x.view(-1, BLOCK)
    s = xb.abs().amax(1, keepdim=True).clamp_min(1e-30)
    return (dec(enc(xb / s)) * s).view(-1)


def gradient_stream(numel: int, steps: int, sigma: float, seed: int = 0) -> list[torch.Tensor]:
    """Per-element scales log-normal (sigma 1: a ~150x spread within a block of 256, 1.5: ~2000x),
    a slowly drifting mean direction plus noise."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(sigma * torch.randn(numel, generator=gen)) * 1e-3
    mean = torch.randn(numel, generator=gen)
    out = []
    for _ in range(steps):
        mean = 0.9 * mean + 0.1 * torch.randn(numel, generator=gen)
        out.append(scale * (0.5 * mean + torch.randn(numel, generator=gen)))
    return out


def measure(numel: int, steps: int, sigma: float, b1: float = 0.9, b2: float = 0.95,
            eps: float = 1e-8) -> list[tuple]:
    grads = gradient_stream(numel, steps, sigma)
    rows = []
    for m_name, m_codec in M_MAPS.items():
        for v_name, v_codec in V_MAPS.items():
            m = torch.zeros(numel)
            v = torch.zeros(numel)
            mq = torch.zeros(numel)
            vq = torch.zeros(numel)
            for t, g in enumerate(grads, 1):
                m.mul_(b1).add_(g * (1 - b1))
                v.mul_(b2).add_(g * g * (1 - b2))
                mq = mq * b1 + g * (1 - b1)
                vq = vq * b2 + g * g * (1 - b2)
                if t < steps:
                    mq = roundtrip(mq, m_codec)
                    vq = roundtrip(vq, v_codec)
            bc1, bc2 = 1 - b1**steps, 1 - b2**steps
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            uq = (mq / bc1) / ((vq / bc2).sqrt() + eps)  # the last step: fp32 moments
            mq, vq = roundtrip(mq, m_codec), roundtrip(vq, v_codec)  # then stored
            rel = ((uq - u).abs() / u.abs().clamp_min(1e-12))
            rows.append((m_name, v_name, ((mq - m).norm() / m.norm()).item(),
                         ((vq - v).norm() / v.norm()).item(),
                         ((uq - u).norm() / u.norm()).item(), rel.quantile(0.95).item()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sigma", type=float, default=1.0)
    args = ap.parse_args()
    rows = measure(args.numel, args.steps, args.sigma)
    print("| m map | v map | m rel err | v rel err | update rel err | update p95 elem err |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.4f} | {r[5]:.4f} |")


if __name__ == "__main__":
    main()

"""The two fp8 formats and the cast that counts what it loses.

E4M3 (4 exponent bits, 3 mantissa bits, max 448) carries weights and activations, E5M2 (max
57344, one mantissa bit less) carries gradients, whose range is wider and whose precision matters
less. A tensor is multiplied by its scale before the cast; the scale is what the scaling rule
(scaling.py) chose for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float
    """Largest finite magnitude."""
    flush_at: float
    """Magnitudes at or below this round to zero (half the smallest subnormal; the tie rounds
    to the even value, zero)."""
    saturate_above: float
    """Magnitudes above this would not round to `max` even in a format with more exponent range:
    clamping them to `max` is an error beyond rounding (half an ulp above `max`)."""
    mantissa_bits: int
    min_quantum: float
    """Spacing of the subnormals (the smallest positive value)."""


# e4m3fn: smallest subnormal 2^-9; the ulp at 448 is 32. e5m2: smallest subnormal 2^-16; the
# ulp at 57344 is 8192.
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-10, 448.0 + 16.0, 3, 2.0**-9)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-17, 57344.0 + 4096.0, 2, 2.0**-16)


def to_fp8(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The cast itself (|y| <= fmt.max)."""
    return y.to(fmt.dtype)


def to_fp8_grid(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The values `y.to(fmt.dtype).float()` gives, computed in fp32 without the fp8 dtype
    (|y| <= fmt.max): round to nearest even at the spacing of y's binade, which is the fp32
    exponent field shifted down by the mantissa bits, never below the subnormal spacing. The
    CPU's fp8-to-fp32 conversion is a slow scalar path; this is a few vector passes."""
    exponent = y.view(torch.int32) & 0x7F800000  # 2^floor(log2|y|), as fp32 bits
    quantum = (exponent - (fmt.mantissa_bits << 23)).view(torch.float32)
    quantum.clamp_min_(fmt.min_quantum)  # zero and subnormal exponents give tiny/negative bits
    return torch.round(y / quantum).mul_(quantum)


def cast_counting(
    x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, *, overflow: bool = True,
    mag: torch.Tensor | None = None, cast: Callable = to_fp8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x * scale) cast to `fmt` by `cast`, saturating at +-max, with the number of values
    flushed to zero (underflow) and of values clamped beyond rounding (overflow; counted only
    when `overflow`: a scale from the tensor's own amax cannot saturate), as device tensors
    (no sync).

    The clamp is explicit because the casts differ by device: the CPU saturates e4m3 but turns
    large e5m2 values into inf; clamping makes every backend saturate the same way.
    """
    xf = x.float()
    mag = xf.abs() if mag is None else mag  # |x|, when the caller has it already
    flush = fmt.flush_at / scale
    underflow = (mag <= flush).sum() - (mag == 0).sum()
    over = (mag > fmt.saturate_above / scale).sum() if overflow else torch.zeros_like(underflow)
    return cast((xf * scale).clamp_(-fmt.max, fmt.max), fmt), underflow, over

"""The two fp8 formats and the cast that counts what it loses.

E4M3 (4 exponent bits, 3 mantissa bits, max 448) carries weights and activations, E5M2 (max
57344, one mantissa bit less) carries gradients, whose range is wider and whose precision matters
less. A tensor is multiplied by its scale before the cast; the scale is what the scaling rule
(scaling.py) chose for it.
"""

from __future__ import annotations

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


# e4m3fn: smallest subnormal 2^-9; the ulp at 448 is 32. e5m2: smallest subnormal 2^-16; the
# ulp at 57344 is 8192.
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-10, 448.0 + 16.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-17, 57344.0 + 4096.0)


def cast_counting(
    x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, *, overflow: bool = True,
    mag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x * scale) as `fmt`, saturating at +-max, with the number of values flushed to zero
    (underflow) and of values clamped beyond rounding (overflow; counted only when `overflow`:
    a scale from the tensor's own amax cannot saturate), as device tensors (no sync).

    The clamp is explicit because the casts differ by device: the CPU saturates e4m3 but turns
    large e5m2 values into inf; clamping makes every backend saturate the same way.
    """
    xf = x.float()
    mag = xf.abs() if mag is None else mag  # |x|, when the caller has it already
    flush = fmt.flush_at / scale
    underflow = (mag <= flush).sum() - (mag == 0).sum()
    over = (mag > fmt.saturate_above / scale).sum() if overflow else torch.zeros_like(underflow)
    return (xf * scale).clamp_(-fmt.max, fmt.max).to(fmt.dtype), underflow, over

"""Per-tensor fp8 scales: the rule that picks a scale (dynamic, delayed or fixed) and the scaler
that applies it to one tensor and keeps its statistics.

A scale multiplies the tensor before the cast (fp8 value = x * scale); the matmul multiplies
by 1 / scale again. The amax (largest magnitude) of every tensor is measured in every mode: it
is what the dynamic rule needs, what the delayed rule records, and what the monitoring reports.

- dynamic: scale = fmt.max / amax of the tensor itself (rounded down to a power of two).
  Nothing saturates; the default.
- delayed: scale = fmt.max / the largest amax of the last N optimizer steps (power of two; the
  scale is fixed within a step, so a recomputed forward quantises exactly as the first one did).
  A tensor that grows beyond its history saturates until the history catches up; a step with no
  history yet uses the dynamic scale.
- fixed: a scale given in the config for activations and one for gradients, the
  troubleshooting switch when measured scales misbehave.

Weights are scaled dynamically in every mode: their amax is exact and known before the step
(when streamed, they are quantised once per step anyway), so a stale or fixed scale would only
add error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tierlm.activations.rerun import recording_is_paused
from tierlm.precision.formats import Fp8Format, cast_counting, to_fp8

TINY_AMAX = 1e-12  # an all-zero tensor gets a large finite scale, not inf

class ScalingRule(Protocol):
    name: str
    saturates: bool  # whether a tensor can exceed the range its scale leaves (else not counted)

    def scale(self, s: TensorScaler, amax: torch.Tensor) -> torch.Tensor: ...

    def end_step(self, s: TensorScaler, step_amax: torch.Tensor) -> None: ...


def dynamic_scale(fmt: Fp8Format, amax: torch.Tensor) -> torch.Tensor:
    """The largest power of two that keeps amax within the format. A power of two makes the
    scaling exact (it only shifts exponents), so a tensor quantised, dequantised and quantised
    again (the tiered runtime's streamed fp8 weights) gets the same scale and the same values."""
    return torch.exp2(torch.floor(torch.log2(fmt.max / amax.clamp_min(TINY_AMAX))))


@dataclass(frozen=True)
class DynamicScaling:
    name: str = "dynamic"
    saturates: bool = False

    def scale(self, s: TensorScaler, amax: torch.Tensor) -> torch.Tensor:
        return dynamic_scale(s.fmt, amax)

    def end_step(self, s: TensorScaler, step_amax: torch.Tensor) -> None:
        pass


@dataclass(frozen=True)
class DelayedScaling:
    history: int = 16
    """Optimizer steps of amax the scale is taken from."""
    name: str = "delayed"
    saturates: bool = True

    def scale(self, s: TensorScaler, amax: torch.Tensor) -> torch.Tensor:
        if s.history is None:
            return dynamic_scale(s.fmt, amax)
        return dynamic_scale(s.fmt, s.history.max())

    def end_step(self, s: TensorScaler, step_amax: torch.Tensor) -> None:
        amax = step_amax.reshape(1)
        if s.history is None:
            s.history = amax.clone()
        else:  # newest first; the oldest step falls off once `history` steps are held
            # a history restored from a checkpoint starts on the CPU
            s.history = torch.cat([amax, s.history.to(amax.device)])[: self.history]


@dataclass(frozen=True)
class FixedScaling:
    value: float
    """The scale, as given (fp8 value = x * value)."""
    name: str = "fixed"
    saturates: bool = True

    def scale(self, s: TensorScaler, amax: torch.Tensor) -> torch.Tensor:
        return torch.full((), self.value, dtype=torch.float32, device=amax.device)

    def end_step(self, s: TensorScaler, step_amax: torch.Tensor) -> None:
        pass


class TensorScaler:
    """Quantises one tensor of one layer (its input, weight or output gradient) and accumulates
    what the cast did over the optimizer step: the step's amax, the last scale, and how many
    values underflowed to zero or saturated. Nothing here synchronises with the device; the
    watch (watch.py) reads all scalers once per step."""

    def __init__(self, name: str, fmt: Fp8Format, rule: ScalingRule) -> None:
        self.name = name
        self.fmt = fmt
        self.rule = rule
        self.recording = True  # off while evaluating: held-out data must not move the scales
        self.history: torch.Tensor | None = None  # delayed scaling: amax per step, newest first
        self._reset()

    def _reset(self) -> None:
        self.step_amax: torch.Tensor | None = None
        self.last_scale: torch.Tensor | None = None
        self.underflow: torch.Tensor | None = None
        self.overflow: torch.Tensor | None = None
        self.count = 0

    def quantize(self, x: torch.Tensor, cast=to_fp8) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in fp8, 1 / scale): what the scaled matmul takes. `cast` makes the fp8 operand
        (the matmul's: an fp8 tensor, or fp32 values on the fp8 grid for the emulation)."""
        xf = x.detach().float()
        mag = xf.abs()
        amax = mag.amax()
        scale = self.rule.scale(self, amax)
        x8, under, over = cast_counting(xf, scale, self.fmt, overflow=self.rule.saturates,
                                        mag=mag, cast=cast)
        if self.recording and not recording_is_paused():
            if self.step_amax is None:
                self.step_amax, self.underflow, self.overflow = amax, under, over
            else:
                self.step_amax = torch.maximum(self.step_amax, amax)
                self.underflow = self.underflow + under
                self.overflow = self.overflow + over
            self.last_scale = scale
            self.count += x.numel()
        return x8, scale.reciprocal()

    def stored(
        self, x8: torch.Tensor, inv_scale: torch.Tensor, cast=to_fp8
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `quantize` returns, for an E4M3 tensor `x8` quantised already with a dynamic
        power-of-two scale (a streamed weight's compute copy): its values in the form `cast`
        gives (the fp8 tensor itself, or its values in fp32 for the emulation) and its 1 /
        scale. The statistics are the ones `quantize` would record for the decoded tensor
        x8 * inv_scale: its amax, the dynamic scale of that amax (the stored scale, or twice
        it where rounding took the amax down to a power of two: either multiplies out to the
        same products), and no underflow, the decoded values being on the grid already."""
        if self.recording and not recording_is_paused():
            # E4M3 magnitudes order as their low seven bits do: the amax without decoding
            top = (x8.view(torch.uint8) & 0x7F).amax().view(x8.dtype).float()
            amax = top * inv_scale
            zero = torch.zeros((), dtype=torch.int64, device=x8.device)
            if self.step_amax is None:
                self.step_amax, self.underflow, self.overflow = amax, zero, zero
            else:
                self.step_amax = torch.maximum(self.step_amax, amax)
            self.last_scale = self.rule.scale(self, amax)
            self.count += x8.numel()
        return (x8 if cast is to_fp8 else x8.float()), inv_scale

    def end_step(self) -> tuple[torch.Tensor, int] | None:
        """The step's [amax, scale, underflowed, overflowed] (device tensor) and the number of
        values cast; None when the tensor was not used this step. Starts the next step."""
        if self.step_amax is None:
            return None
        out = torch.stack([self.step_amax, self.last_scale, self.underflow.float(),
                           self.overflow.float()])
        count = self.count
        self.rule.end_step(self, self.step_amax)
        self._reset()
        return out, count

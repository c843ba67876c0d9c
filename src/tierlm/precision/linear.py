"""Linear layers that compute in the precision the policy gave them.

`PrecisionLinear` replaces an `nn.Linear` (or GPT-2's `Conv1D`, whose weight is stored
transposed) and keeps the original `weight` and `bias` Parameters, so parameter names,
checkpoints, tied weights and the tiered runtime's `functional_call` views are unchanged; only
the matmul differs. Its `compute` is one of:

- `Fp32Linear`: autocast off, fp32 operands (sensitive layers, e.g. the output head).
- `Bf16Linear`: bf16 operands, as autocast would cast them (regular layers, and fp8 layers that
  fell back); the weight gradient, and the gradient of an fp32 input, are summed and returned
  in fp32.
- `Fp8Linear`: E4M3 input and weight, E5M2 output gradient, per-tensor scales, fp32
  accumulation; the weight gradient is returned in fp32.

A weight (or bias) may come in its stored compute form (`Stored`: the tiered runtime's device
copy, tierlm.precision.streaming): the tensor the layer is called with is then an fp32
stand-in without values that only carries the gradient back to the fp32 master's flat gradient
(autograd would round a gradient to the dtype of the tensor it flows into), and the matmul reads
the stored bf16 values, or the stored E4M3 values with their scale, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tierlm.precision.formats import E4M3, E5M2
from tierlm.precision.matmul import Fp8Matmul
from tierlm.precision.scaling import DynamicScaling, ScalingRule, TensorScaler


@dataclass(frozen=True)
class Stored:
    """A weight in the form its compute copy holds it: bf16 values, or E4M3 values and the
    reciprocal of their (power-of-two) scale, a 0-dim fp32 tensor."""

    values: torch.Tensor
    inv_scale: torch.Tensor | None = None

    def t(self) -> Stored:
        return Stored(self.values.t(), self.inv_scale)


# stand-in tensor -> the stored form it stands for (weak: a run's views die with the run)
_STORED = WeakIdKeyDictionary()


def stand_in(grad_sink: torch.Tensor, stored: Stored) -> torch.Tensor:
    """Mark `grad_sink` (an fp32 tensor of the weight's shape, without values of its own) as
    standing for `stored` in the layers below."""
    _STORED[grad_sink] = stored
    return grad_sink


def stored_of(t: torch.Tensor | None) -> Stored | None:
    return None if t is None else _STORED.get(t)


def _bf16_of(t: torch.Tensor) -> torch.Tensor:
    """t's values in bf16: the stored bf16 copy where `t` stands in for one."""
    stored = stored_of(t)
    return t.to(torch.bfloat16) if stored is None else stored.values


class Fp32Linear:
    name = "fp32"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), w.float(), None if b is None else b.float())


_MM_OUT_DTYPE_WORKS: bool | None = None  # CUDA mm with out_dtype: probed on first use


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands with the products summed into an fp32 result, never rounded to
    bf16: CUDA's mm with out_dtype where this torch has it, else the bf16 values widened to fp32
    (exact) and multiplied there."""
    global _MM_OUT_DTYPE_WORKS
    if a.is_cuda and _MM_OUT_DTYPE_WORKS is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE_WORKS = True
            return out
        except (RuntimeError, TypeError):
            _MM_OUT_DTYPE_WORKS = False  # not in this build: don't raise on every backward
    return torch.mm(a.float(), b.float())


class _Bf16LinearFn(torch.autograd.Function):
    """y = x @ w.T + b on bf16 operands (autocast's rounding); the backward multiplies bf16
    operands too, but sums into fp32 results wherever fp32 receives them: the weight gradient
    (for the fp32 master gradient) and the gradient of an fp32 input (the output of a norm,
    on its way into the fp32 residual stream), as the fp8 layers do. Autocast rounds both to bf16
    (8 significant bits), which on Shakespeare cost +5.1% held-out perplexity against fp32 after
    150 steps; with fp32 weight gradients it was +3.3%, with both -0.4% (bench/
    precision_parity.py). The price is fp32 outputs of two GEMMs in the backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        xb, wb = x.to(torch.bfloat16), _bf16_of(w)
        out = F.linear(xb, wb, None if b is None else _bf16_of(b))
        ctx.save_for_backward(xb, wb)
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, w.dtype, b is not None
        return out

    @staticmethod
    def backward(ctx, gout):
        xb, wb = ctx.saved_tensors
        g = gout.to(torch.bfloat16)
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[0]:
            if ctx.x_dtype == torch.bfloat16:  # rounded to the input's bf16 either way
                gx = g @ wb
            else:  # an fp32 input (a norm's output): its gradient keeps fp32
                gx = _mm_fp32_out(g2, wb).reshape(*g.shape[:-1], wb.shape[1]).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gw = _mm_fp32_out(g2.t(), xb.reshape(-1, xb.shape[-1])).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gout.reshape(-1, gout.shape[-1]).float().sum(0)
        return gx, gw, gb


class Bf16Linear:
    name = "bf16"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return _Bf16LinearFn.apply(x, w, b)


class Fp8LayerScalers:
    """The three fp8 tensors of one layer. Weights always take the dynamic rule (scaling.py)."""

    def __init__(self, layer: str, input_rule: ScalingRule, grad_rule: ScalingRule) -> None:
        self.layer = layer
        self.input = TensorScaler(f"{layer}.input", E4M3, input_rule)
        self.weight = TensorScaler(f"{layer}.weight", E4M3, DynamicScaling())
        self.grad = TensorScaler(f"{layer}.grad", E5M2, grad_rule)

    def all(self) -> tuple[TensorScaler, TensorScaler, TensorScaler]:
        return self.input, self.weight, self.grad


class _Fp8LinearFn(torch.autograd.Function):
    """y = x @ w.T + b with both operands in E4M3; backward with the output gradient in E5M2.
    Saves the quantised operands (1 byte per value with the fp8 kernel) rather than the
    inputs."""

    @staticmethod
    def forward(ctx, x, w, b, scalers: Fp8LayerScalers, mm: Fp8Matmul, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
        x8, x_inv = scalers.input.quantize(x2, mm.cast)
        stored = stored_of(w)
        if stored is None:
            w8, w_inv = scalers.weight.quantize(w, mm.cast)  # (out, in)
        else:  # quantised already, with the scale `quantize` would choose (streaming.py)
            w8, w_inv = scalers.weight.stored(stored.values, stored.inv_scale, mm.cast)
        out = mm(x8, w8.t(), x_inv, w_inv, out_dtype)  # (tokens, out)
        if b is not None:
            b_stored = stored_of(b)
            out = out + (b if b_stored is None else b_stored.values).to(out_dtype)
        ctx.save_for_backward(x8, w8, x_inv, w_inv)
        ctx.scalers, ctx.mm = scalers, mm
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype
        ctx.has_bias = b is not None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, gout):
        x8, w8, x_inv, w_inv = ctx.saved_tensors
        g2 = gout.reshape(-1, gout.shape[-1])  # (tokens, out)
        g8, g_inv = ctx.scalers.grad.quantize(g2, ctx.mm.cast)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = ctx.mm(g8, w8, g_inv, w_inv, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # accumulated in fp32 whatever the activations' dtype
            gw = ctx.mm(g8.t(), x8, g_inv, x_inv, torch.float32).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.float().sum(0)
        return gx, gw, gb, None, None, None


class Fp8Linear:
    name = "fp8"

    def __init__(self, scalers: Fp8LayerScalers, mm: Fp8Matmul) -> None:
        self.scalers = scalers
        self.mm = mm

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        # Inside autocast the output takes autocast's dtype, as a plain linear's would.
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            return _Fp8LinearFn.apply(x, w, b, self.scalers, self.mm, out_dtype)


class PrecisionLinear(nn.Module):
    def __init__(
        self, name: str, source: nn.Module, compute, *, transposed: bool
    ) -> None:
        super().__init__()
        self.layer_name = name
        self.transposed = transposed  # GPT-2 Conv1D: weight is (in, out)
        self.weight = source.weight
        self.register_parameter("bias", source.bias)
        out_dim, in_dim = source.weight.shape[::-1] if transposed else source.weight.shape
        self.in_features, self.out_features = int(in_dim), int(out_dim)
        self.compute = compute

    def functional(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer on given tensors (the tiered runtime's head passes its own views)."""
        if self.transposed:
            stored = stored_of(weight)
            weight = weight.t()
            if stored is not None:
                stand_in(weight, stored.t())
        return self.compute(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.functional(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: in={self.in_features}, out={self.out_features}, "
                f"compute={self.compute.name}")

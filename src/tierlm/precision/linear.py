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

A weight (or bias) may come with its stored compute form (the tiered runtime's device copy,
tierlm.precision.streaming): bf16 values, or E4M3 values and the reciprocal of their scale. The
weight tensor the layer is called with is then an fp32 stand-in without values that only carries
the gradient back to the fp32 master's flat gradient (autograd would round a gradient to the
dtype of the tensor it flows into), and the matmul reads the stored values instead. The stored
tensors reach the layer as buffers (`weight_stored`, `weight_inv_scale`, `bias_stored`, None
unless given) that the runtime's `functional_call` swaps in beside the parameters: plain inputs,
so a compiled block (tierlm.runtime.compile) takes them as graph inputs like the weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.precision.formats import E4M3, E5M2
from tierlm.precision.matmul import Fp8Matmul
from tierlm.precision.scaling import DynamicScaling, ScalingRule, TensorScaler

STORED, INV_SCALE = "_stored", "_inv_scale"
"""Suffixes of the buffers (and of the runtime's view names) that carry a parameter's stored
values and, for E4M3, the reciprocal of its scale: `q_proj.weight` -> `q_proj.weight_stored`."""


def _bf16_of(t: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
    """t's values in bf16: the stored bf16 copy where `t` stands in for one."""
    return t.to(torch.bfloat16) if stored is None else stored


class Fp32Linear:
    """fp32 layers have no stored form (their compute copy is fp32): `stored` is always empty."""

    name = "fp32"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 *stored: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), w.float(), None if b is None else b.float())


_MM_OUT_DTYPE_WORKS: bool | None = None  # CUDA mm with out_dtype: probed once, eagerly


def probe_fp32_out_mm(device: torch.device) -> None:
    """Find out once, outside any compiled graph, whether this build's CUDA mm sums bf16
    operands into an fp32 result (`out_dtype`); `prepare_precision` calls it at setup."""
    global _MM_OUT_DTYPE_WORKS
    if device.type != "cuda" or _MM_OUT_DTYPE_WORKS is not None:
        return
    a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        _MM_OUT_DTYPE_WORKS = True
    except (RuntimeError, TypeError):
        _MM_OUT_DTYPE_WORKS = False


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands with the products summed into an fp32 result, never rounded to
    bf16: CUDA's mm with out_dtype where this torch has it, else the bf16 values widened to fp32
    (exact) and multiplied there."""
    if a.is_cuda and _MM_OUT_DTYPE_WORKS is None and not torch.compiler.is_compiling():
        probe_fp32_out_mm(a.device)
    if a.is_cuda and _MM_OUT_DTYPE_WORKS:
        return torch.mm(a, b, out_dtype=torch.float32)
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
    def forward(ctx, x, w, b, w_stored, b_stored):
        xb, wb = x.to(torch.bfloat16), _bf16_of(w, w_stored)
        out = F.linear(xb, wb, None if b is None else _bf16_of(b, b_stored))
        ctx.save_for_backward(xb, wb)
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, w.dtype, b is not None
        return out

    @staticmethod
    def backward(ctx, gout):
        # Eager autograd runs this outside autocast; a compiled graph traces it under the
        # forward's autocast, which would take the fp32 GEMMs below back to bf16.
        with torch.autocast(gout.device.type, enabled=False):
            return _Bf16LinearFn._backward(ctx, gout)

    @staticmethod
    def _backward(ctx, gout):
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
        return gx, gw, gb, None, None


class Bf16Linear:
    name = "bf16"

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
        w_stored: torch.Tensor | None = None, w_inv_scale: torch.Tensor | None = None,
        b_stored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return _Bf16LinearFn.apply(x, w, b, w_stored, b_stored)


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
    def forward(ctx, x, w, b, w_stored, w_inv_scale, b_stored, scalers: Fp8LayerScalers,
                mm: Fp8Matmul, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
        x8, x_inv = scalers.input.quantize(x2, mm.cast)
        if w_stored is None:
            w8, w_inv = scalers.weight.quantize(w, mm.cast)  # (out, in)
        else:  # quantised already, with the scale `quantize` would choose (streaming.py)
            w8, w_inv = scalers.weight.stored(w_stored, w_inv_scale, mm.cast)
        out = mm(x8, w8.t(), x_inv, w_inv, out_dtype)  # (tokens, out)
        if b is not None:
            out = out + (b if b_stored is None else b_stored).to(out_dtype)
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
        return gx, gw, gb, None, None, None, None, None, None


class Fp8Linear:
    name = "fp8"

    def __init__(self, scalers: Fp8LayerScalers, mm: Fp8Matmul) -> None:
        self.scalers = scalers
        self.mm = mm

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
        w_stored: torch.Tensor | None = None, w_inv_scale: torch.Tensor | None = None,
        b_stored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Inside autocast the output takes autocast's dtype, as a plain linear's would.
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            return _Fp8LinearFn.apply(x, w, b, w_stored, w_inv_scale, b_stored, self.scalers,
                                      self.mm, out_dtype)


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
        # the stored compute form, swapped in per call by the tiered runtime (see the top)
        for buffer in ("weight" + STORED, "weight" + INV_SCALE, "bias" + STORED):
            self.register_buffer(buffer, None, persistent=False)

    def functional(
        self, x: torch.Tensor, views: Mapping[str, torch.Tensor], weight_name: str,
        bias_name: str | None,
    ) -> torch.Tensor:
        """The layer on tensors given by name, stored forms under the names' suffixed keys (the
        tiered runtime's head passes its views, where a tied weight is named after its owner)."""
        w_name, b_name = weight_name, bias_name or ""
        return self._run(x, views[w_name], views.get(b_name), views.get(w_name + STORED),
                         views.get(w_name + INV_SCALE), views.get(b_name + STORED))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.weight, self.bias, self.weight_stored, self.weight_inv_scale,
                         self.bias_stored)

    def _run(self, x, weight, bias, w_stored, w_inv_scale, b_stored) -> torch.Tensor:
        if self.transposed:  # GPT-2 Conv1D: (in, out), the stored values too
            weight = weight.t()
            w_stored = None if w_stored is None else w_stored.t()
        return self.compute(x, weight, bias, w_stored, w_inv_scale, b_stored)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: in={self.in_features}, out={self.out_features}, "
                f"compute={self.compute.name}")

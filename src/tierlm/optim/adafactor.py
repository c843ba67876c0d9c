"""Adafactor over flat segment state, with the semantics of `torch.optim.Adafactor` as the
reference trainer builds it (tierlm.optim.build): a parameter with two or more dimensions keeps
its second moment factored into a row and a column statistic over its last two dimensions,
a vector keeps it whole; the step is scaled by the parameter's RMS (at least eps2) times
rho_t = min(lr, 1/sqrt(t)), and clipped so the update's RMS is at most d.

On the CPU the segment's step is one call of a C kernel (tierlm.optim.native: two passes over
each parameter where torch's operations make about fifteen and allocate four temporaries); it
agrees with torch.optim.Adafactor to a few units in the last place, and a run uses it
throughout, so resumes stay bit for bit. Elsewhere, where no compiler is found, or with
`native=False`, the step is the same sequence of torch operations the reference runs, on views
of the flat buffers in each parameter's own shape, bit for bit equal to it. Both the RMS scale
and the clipping need whole parameters, and the factored statistics are not elementwise: the
optimizer takes whole segments (`align = 0`).
"""

from __future__ import annotations

import math

import torch

from tierlm.memory.layout import FlatLayout, ParamSlot
from tierlm.optim import native as kernels  # `native` names the flag below
from tierlm.optim.flat import FlatOptimizer, StateSlot, step_count

# torch.optim.Adafactor's settings as the reference trainer passes them
BETA2_DECAY = -0.8
EPS = (None, 1e-3)  # eps1 None: the dtype's machine epsilon
D = 1.0


def _factored(p: ParamSlot) -> bool:
    return len(p.shape) >= 2


def _row_shape(p: ParamSlot) -> tuple[int, ...]:
    return (*p.shape[:-1], 1) if _factored(p) else (0,)


def _col_shape(p: ParamSlot) -> tuple[int, ...]:
    return (*p.shape[:-2], 1, p.shape[-1]) if _factored(p) else (0,)


def _var_shape(p: ParamSlot) -> tuple[int, ...]:
    return (0,) if _factored(p) else p.shape


def _slot(name: str, shape_of) -> StateSlot:
    return StateSlot(name, numel_of=lambda p: math.prod(shape_of(p)), shape_of=shape_of, block=0)


class FlatAdafactor(FlatOptimizer):
    name = "Adafactor"
    # the reference's state keys; a parameter owns either row_var and col_var or variance
    slots = (_slot("row_var", _row_shape), _slot("col_var", _col_shape),
             _slot("variance", _var_shape))
    align = 0
    # bench/optimizer_update.py, 16.8M params: 0.5-0.7x fused AdamW's params/s with the C
    # kernel (its eager fallback: 0.06x, a cost near 16)
    cpu_cost = 1.5

    def __init__(self, cfg, *, native: bool = True) -> None:
        super().__init__(cfg)
        self.native = native

    def update_range(
        self,
        layout: FlatLayout,
        lo: int,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        steps: list[torch.Tensor],
        lr: float,
    ) -> None:
        if lo != 0 or master.numel() != layout.numel:
            raise ValueError("Adafactor updates whole segments (align = 0)")
        counts = {decay: step for (_, _, decay), step in zip(layout.groups(), steps,
                                                              strict=True)}
        eps1, eps2 = EPS
        # (p, t, weight decay, eps1) per parameter
        todo = [(p, step_count(counts[p.decay]) + 1, self.cfg.weight_decay if p.decay else 0.0,
                 torch.finfo(master.dtype).eps if eps1 is None else eps1)
                for p in layout.slots]
        on_cpu = master.device.type == "cpu" and master.dtype == torch.float32
        fn = kernels.adafactor_kernel() if self.native and on_cpu else None
        if fn is not None:  # the whole segment in one call
            at = [s.offsets(layout) for s in self.slots]
            kernels.run_adafactor(
                fn, master, grad, *(state[s.name] for s in self.slots),
                [(p.offset, p.shape, at[0][i], at[1][i], at[2][i]) for i, p in
                 enumerate(layout.slots)],
                [(t**BETA2_DECAY, min(lr, 1 / (t**0.5)), 1 - lr * wd, e1, eps2, D)
                 for _, t, wd, e1 in todo])
            return
        row, col, var = (s.views(layout, state[s.name]) for s in self.slots)
        for p, t, wd, e1 in todo:
            _adafactor_step(master[p.offset : p.offset + p.numel].view(p.shape),
                            grad[p.offset : p.offset + p.numel].view(p.shape), row[p.name],
                            col[p.name], var[p.name], t, lr=lr, weight_decay=wd, eps1=e1,
                            eps2=eps2)


def _adafactor_step(
    param: torch.Tensor, grad: torch.Tensor, row_var: torch.Tensor, col_var: torch.Tensor,
    variance: torch.Tensor, t: float, *, lr: float, weight_decay: float, eps1: float,
    eps2: float, host_scale: bool | None = None,
) -> None:
    """One step of torch.optim.Adafactor (single-tensor path) on one parameter at count `t`.
    Its two data-dependent scalars (the RMS scale and the clipping divisor) stay 0-dim fp64
    tensors on the parameter's device, computed as torch computes them in Python floats; only
    the final add differs by device (`_add_scaled`; `host_scale`: None, the CPU's way where
    `param` is in host memory)."""
    one_minus_beta2_t = t**BETA2_DECAY
    rho_t = min(lr, 1 / (t**0.5))

    def scalar(value: float) -> torch.Tensor:  # made on the device by a fill, no copy
        return torch.full((), value, dtype=torch.float64, device=param.device)

    # torch.fmax(x, c) is Python's max(c, x), NaN included
    alpha = torch.fmax(param.norm(2).double() / scalar(param.numel() ** 0.5), scalar(eps2))
    alpha.mul_(rho_t)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        # mean of g*g over the last (then the second-last) dimension without materialising g*g
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance.lerp_(grad * grad, one_minus_beta2_t)
        var_estimate = variance.clone()
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = torch.fmax(update.norm(2).double() / scalar((update.numel() ** 0.5) * D),
                       scalar(1.0))
    if host_scale is None:
        host_scale = param.device.type == "cpu"
    _add_scaled(param, update, alpha.neg_().div_(denom), host_scale)


def _add_scaled(param: torch.Tensor, update: torch.Tensor, scale: torch.Tensor,
                host_scale: bool) -> None:
    """param += scale * update, `scale` a 0-dim fp64 tensor beside `param`. `host_scale`: as
    torch.optim.Adafactor adds, with the scale as a number (one rounding, the add's alpha):
    reading it is free in host memory, and would wait for the whole queue on an accelerator.
    Else the scale stays on the device and the product rounds once more than torch's (within
    an ulp of each value)."""
    if host_scale:
        param.add_(update, alpha=scale.item())
    else:
        param.add_(update.mul_(scale.to(update.dtype)))


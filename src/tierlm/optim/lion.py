"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one moment, a sign
update, decoupled weight decay. Per step, with g the gradient and m the moment:

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g

`Lion` is the reference trainer's `torch.optim.Optimizer`; `FlatLion` runs the same arithmetic on
a segment's flat slices. Both use only elementwise multiplies and adds (no fused multiply-add,
no lerp), each correctly rounded whatever the tensor's shape or vectorisation, so the two agree
bit for bit. Its usual learning rate is 3-10x smaller than AdamW's and betas (0.9, 0.99).
"""

from __future__ import annotations

import torch

from tierlm.memory.layout import FlatLayout
from tierlm.optim import native
from tierlm.optim.flat import FlatOptimizer, StateSlot


def lion_update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float, beta1: float, beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step on contiguous tensors of any (equal) shape, in place on `p` and `m`: one
    pass of the C kernel on the CPU (tierlm.optim.native; eager PyTorch makes eight passes and
    allocates three temporaries, measured 10x slower than fused AdamW), the same operations in
    PyTorch elsewhere. Both round every operation to fp32 alike."""
    fn = native.lion_kernel() if p.device.type == "cpu" and p.dtype == torch.float32 else None
    if fn is not None and p.is_contiguous() and g.is_contiguous() and m.is_contiguous():
        h = torch.tensor([beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * weight_decay, lr],
                         dtype=torch.float32)
        native.run_lion(fn, p, g, m, h)
        return
    c = m * beta1
    c += g * (1 - beta1)
    p.mul_(1 - lr * weight_decay)
    p.sub_(c.sign_().mul_(lr))  # sign(c) * lr is exact: +-lr or 0
    m.mul_(beta2)
    m.add_(g * (1 - beta2))


class Lion(torch.optim.Optimizer):
    """Lion for the reference trainer; state per parameter: `exp_avg`, `step`."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: invalid lr {lr}, betas {betas} or weight_decay "
                             f"{weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                state["step"] += 1
                lion_update(p, p.grad, state["exp_avg"], lr=group["lr"], beta1=beta1,
                            beta2=beta2, weight_decay=group["weight_decay"])
        return loss


class FlatLion(FlatOptimizer):
    name = "Lion"
    slots = (StateSlot("exp_avg"),)
    align = 1
    # bench/optimizer_update.py, 16.8M params: 1.4x fused AdamW's params/s (C kernel)
    cpu_cost = 0.7

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
        """Lion keeps no use for the count; the counters are kept for the checkpoint's `.step`
        keys (the reference writes them too)."""
        hi = lo + master.numel()
        for start, length, decay in layout.groups():
            a, b = max(start, lo) - lo, min(start + length, hi) - lo
            if a < b:
                lion_update(master[a:b], grad[a:b], state["exp_avg"][a:b], lr=lr,
                            beta1=self.cfg.beta1, beta2=self.cfg.beta2,
                            weight_decay=self.cfg.weight_decay if decay else 0.0)

"""AdamW over flat buffers: the same fused kernel `torch.optim.AdamW(fused=True)` runs, applied to
contiguous slices (one per weight-decay group) instead of one tensor per parameter. The update is
elementwise, so the result is identical to the per-parameter optimizer's."""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from tierlm.memory.layout import FlatLayout
from tierlm.optim.flat import FlatOptimizer, StateSlot, device_steps


class FlatAdamW(FlatOptimizer):
    name = "AdamW"
    # the reference trainer's state keys, so either runtime resumes the other's checkpoint
    slots = (StateSlot("exp_avg"), StateSlot("exp_avg_sq"))
    align = 1

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
        """A group the range cuts is stepped on its part here, the rest in other ranges; each
        part sees its group's count plus one on a copy of the counter, so every range of one
        optimizer step uses the same count."""
        hi = lo + master.numel()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        for (start, length, decay), step in zip(layout.groups(), steps, strict=True):
            a, b = max(start, lo), min(start + length, hi)
            if a >= b:
                continue
            adam(
                [master[a - lo : b - lo]],
                [grad[a - lo : b - lo]],
                [exp_avg[a - lo : b - lo]],
                [exp_avg_sq[a - lo : b - lo]],
                [],
                device_steps(step, master.device),  # the kernel advances this copy
                fused=True,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=self.cfg.beta1,
                beta2=self.cfg.beta2,
                lr=lr,
                weight_decay=self.cfg.weight_decay if decay else 0.0,
                eps=self.cfg.eps,
                maximize=False,
            )

"""AdamW over flat buffers: the same fused kernel `torch.optim.AdamW(fused=True)` runs, applied to
contiguous slices (one per weight-decay group) instead of one tensor per parameter. The update is
elementwise, so the result is identical to the per-parameter optimizer's."""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from tierlm.config import OptimConfig


class FlatAdamW:
    def __init__(self, cfg: OptimConfig) -> None:
        if cfg.name != "AdamW":
            raise ValueError(f"the tiered runtime has AdamW only; --opt {cfg.name} is not "
                             "supported with --offload-policy yet")
        self.cfg = cfg

    def update(
        self,
        groups: list[tuple[int, int, bool]],
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        steps: list[torch.Tensor],
        lr: float,
    ) -> None:
        """One step on each (start, length, decay) group; `steps[g]` is that group's counter."""
        self.update_range(groups, 0, master, grad, exp_avg, exp_avg_sq, steps, lr)
        advance(steps)

    def update_range(
        self,
        groups: list[tuple[int, int, bool]],
        lo: int,
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        steps: list[torch.Tensor],
        lr: float,
    ) -> None:
        """One step on elements [lo, lo + master.numel()) of a segment's flat state, whose
        buffers for that range are given (a chunk staged from disk). A group the range cuts
        is stepped on its part here, the rest in other ranges; each part sees its group's count
        plus one on a copy of the counter, so every range of one optimizer step uses the same
        count, and `advance(steps)` moves the counters once after the last range."""
        hi = lo + master.numel()
        for (start, length, decay), step in zip(groups, steps, strict=True):
            a, b = max(start, lo), min(start + length, hi)
            if a >= b:
                continue
            adam(
                [master[a - lo : b - lo]],
                [grad[a - lo : b - lo]],
                [exp_avg[a - lo : b - lo]],
                [exp_avg_sq[a - lo : b - lo]],
                [],
                [step.clone()],  # the kernel advances this copy, not the group's counter
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


def advance(steps: list[torch.Tensor]) -> None:
    """Count one optimizer step on every group (after `update_range` covered the segment)."""
    for step in steps:
        step.add_(1)


def new_step_counter(device: torch.device) -> torch.Tensor:
    """The per-group step count, as the fused optimizer keeps it (fp32 scalar on the device)."""
    return torch.zeros((), dtype=torch.float32, device=device)

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
        for (start, length, decay), step in zip(groups, steps, strict=True):
            adam(
                [master.narrow(0, start, length)],
                [grad.narrow(0, start, length)],
                [exp_avg.narrow(0, start, length)],
                [exp_avg_sq.narrow(0, start, length)],
                [],
                [step],
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


def new_step_counter(device: torch.device) -> torch.Tensor:
    """The per-group step count, as the fused optimizer keeps it (fp32 scalar on the device)."""
    return torch.zeros((), dtype=torch.float32, device=device)

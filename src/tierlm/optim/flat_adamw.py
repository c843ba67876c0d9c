"""AdamW over flat buffers: the same fused kernel `torch.optim.AdamW(fused=True)` runs, applied to
contiguous slices (one per weight-decay group) instead of one tensor per parameter. The update is
elementwise, so the result is identical to the per-parameter optimizer's.

`freeze_variance_after = n` (set by top-k gradient sync, see tierlm.distributed.topk) stops the
second moment after a group's n-th step: later steps divide by the frozen sqrt(v) (bias
corrected at step n) and only the first moment moves. AdamW is then linear in the gradient, so
a gradient that error feedback delivers late, in one piece, moves the weights as much in total
as the dense gradient would have; with a moving v such a burst also inflates v and is
damped."""

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
        self.freeze_variance_after: int | None = None

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
            n = self.freeze_variance_after
            if n is not None and step.item() >= n:
                self._frozen_variance_step(
                    master.narrow(0, start, length), grad.narrow(0, start, length),
                    exp_avg.narrow(0, start, length), exp_avg_sq.narrow(0, start, length),
                    step, lr, self.cfg.weight_decay if decay else 0.0, n,
                )
                continue
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


    def _frozen_variance_step(self, p, g, m, v, step, lr: float, wd: float, n: int) -> None:
        """AdamW's step with v as it was after step n (the fused kernel's formula otherwise)."""
        b1, b2 = self.cfg.beta1, self.cfg.beta2
        step.add_(1)
        t = step.item()
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        denom = v.sqrt().div_((1 - b2**n) ** 0.5).add_(self.cfg.eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def new_step_counter(device: torch.device) -> torch.Tensor:
    """The per-group step count, as the fused optimizer keeps it (fp32 scalar on the device)."""
    return torch.zeros((), dtype=torch.float32, device=device)

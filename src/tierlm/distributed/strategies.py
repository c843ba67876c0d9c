"""The gradient-sync strategy a run's `distributed` section asks for, as a typed config: dense
(tierlm.distributed.sync), top-k (tierlm.distributed.topk) or delayed
(tierlm.distributed.delayed). Each config sits beside the strategy it builds (`build(comm)`);
this module, above all three, only chooses one."""

from __future__ import annotations

from typing import Any

from tierlm.distributed.checks import parse_ratio_overrides, resolved_mode
from tierlm.distributed.delayed import DelayedSync
from tierlm.distributed.sync import DenseSync
from tierlm.distributed.topk import TopKSync

SyncConfig = DenseSync | TopKSync | DelayedSync


def sync_config(dist_cfg: Any, max_steps: int) -> SyncConfig:
    """The typed strategy config for the `distributed` section (already validated)."""
    mode = resolved_mode(dist_cfg)
    if mode == "topk":
        return TopKSync(
            ratio=dist_cfg.sparse_grad_ratio,
            overrides=parse_ratio_overrides(dist_cfg.sparse_grad_ratio_overrides),
            error_feedback=dist_cfg.error_feedback,
            feedback=dist_cfg.topk_feedback,
            warmup_steps=dist_cfg.sparse_warmup_steps,
        )
    if mode == "delayed":
        return DelayedSync(every=dist_cfg.sync_every, final_step=max_steps,
                           moments=dist_cfg.sync_moments)
    return DenseSync(dtype=dist_cfg.grad_sync_dtype)

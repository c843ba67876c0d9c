"""Optimizers over the model's parameters (later: over the runtime's flat buffers)."""

from tierlm.optim.build import build_optimizer, param_groups

__all__ = ["build_optimizer", "param_groups"]

"""Optimizers: over the model's parameters (the reference trainer) and over the runtime's flat
segment state (tierlm.optim.flat), one pair per `--opt` name (tierlm.optim.build)."""

from tierlm.optim.build import (
    OPTIMIZERS,
    build_flat_optimizer,
    build_optimizer,
    model_state_nbytes,
    param_groups,
)

__all__ = [
    "OPTIMIZERS", "build_flat_optimizer", "build_optimizer", "model_state_nbytes", "param_groups",
]

"""A flat optimizer's update reads the gradient and never writes it: a speculative disk-tier
update (tierlm.runtime.update, `--speculative-update`) runs with the coefficient 1 before the
global norm is known, and where the norm then asks for a smaller coefficient the update is redone
from the same gradient, which must still be the one the backward left."""

from __future__ import annotations

import pytest
import torch

from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.optim import OPTIMIZERS, build_flat_optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_update_leaves_the_gradient_as_it_found_it(name):
    torch.manual_seed(0)
    layout = FlatLayout([("w", (48, 32), True), ("b", (48,), False), ("v", (32, 16), True)])
    opt = build_flat_optimizer(OptimConfig(name=name))
    master = torch.randn(layout.numel)
    grad = torch.randn(layout.numel)
    before = grad.clone()
    state = {s.name: torch.zeros(s.numel(layout), dtype=s.dtype) for s in opt.slots}
    steps = [torch.zeros(()) for _ in layout.groups()]
    for lo, n in opt.chunk_ranges(layout, layout.numel):
        for _ in range(2):  # a second update: every slot is non-zero by then
            opt.update_range(layout, lo, master[lo:lo + n], grad[lo:lo + n],
                             {k: v for k, v in state.items()}, steps, 1e-3)
            for s in steps:
                s.add_(1)
    assert torch.equal(grad, before), name

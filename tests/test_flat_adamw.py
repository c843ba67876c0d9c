"""FlatAdamW: the fused kernel on flat slices, and the frozen-variance steps top-k sync uses."""

from __future__ import annotations

import dataclasses

import torch

from tierlm.config import OptimConfig
from tierlm.optim.flat_adamw import FlatAdamW, new_step_counter

CFG = dataclasses.replace(OptimConfig(), weight_decay=0.1)


def _run(freeze: int | None, grads: list[torch.Tensor]):
    opt = FlatAdamW(CFG)
    opt.freeze_variance_after = freeze
    p = torch.linspace(-1, 1, 64)
    m, v = torch.zeros(64), torch.zeros(64)
    steps = [new_step_counter(torch.device("cpu")), new_step_counter(torch.device("cpu"))]
    vs = []
    for g in grads:
        opt.update([(0, 40, True), (40, 24, False)], p, g.clone(), m, v, steps, 1e-2)
        vs.append(v.clone())
    return p, m, vs, steps


def test_unfrozen_is_torch_adamw():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, generator=gen) for _ in range(5)]
    p, _, _, _ = _run(None, grads)
    ref = torch.nn.Parameter(torch.linspace(-1, 1, 64))
    ref2 = torch.nn.Parameter(ref.detach()[40:].clone())
    ref1 = torch.nn.Parameter(ref.detach()[:40].clone())
    opt = torch.optim.AdamW(
        [{"params": [ref1], "weight_decay": 0.1}, {"params": [ref2], "weight_decay": 0.0}],
        lr=1e-2, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True)
    for g in grads:
        ref1.grad, ref2.grad = g[:40].clone(), g[40:].clone()
        opt.step()
    assert torch.equal(p, torch.cat([ref1.detach(), ref2.detach()]))


def test_frozen_variance_stops_v_and_keeps_adamw_otherwise():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(64, generator=gen) for _ in range(6)]
    p_free, _, _, _ = _run(None, grads[:3])
    p3, m, vs, steps = _run(3, grads)
    _, _, vs_free, _ = _run(None, grads)
    assert torch.equal(vs[2], vs_free[2])  # the first 3 steps are plain AdamW
    assert all(torch.equal(v, vs[2]) for v in vs[3:])  # then v stands still ...
    assert not torch.equal(vs_free[5], vs_free[2])  # ... where AdamW's would move
    assert [int(s) for s in steps] == [6, 6]
    # step 4..6 by hand: AdamW with v frozen (bias-corrected at step 3)
    b1, b2, lr = CFG.beta1, CFG.beta2, 1e-2
    p, mm = p_free.clone(), _run(None, grads[:3])[1].clone()
    wd = torch.cat([torch.full((40,), 0.1), torch.zeros(24)])
    for t, g in zip((4, 5, 6), grads[3:], strict=True):
        p = p * (1 - lr * wd)
        mm = b1 * mm + (1 - b1) * g
        p = p - lr / (1 - b1**t) * mm / (vs[2].sqrt() / (1 - b2**3) ** 0.5 + CFG.eps)
    torch.testing.assert_close(p3, p, rtol=1e-6, atol=1e-7)


def test_frozen_variance_turns_a_delayed_burst_into_the_same_total_move():
    """What error feedback does to one entry: 20 small gradients held back and delivered as
    one. With v frozen and no momentum decay left to differ, the total move matches; with v
    moving, the burst is damped."""
    cfg = dataclasses.replace(CFG, weight_decay=0.0, beta1=0.0)
    moves = {}
    for freeze in (None, 1):
        for burst in (False, True):
            opt = FlatAdamW(cfg)
            opt.freeze_variance_after = freeze
            p, m, v = torch.zeros(1), torch.zeros(1), torch.zeros(1)
            step = [new_step_counter(torch.device("cpu"))]
            opt.update([(0, 1, False)], p, torch.ones(1), m, v, step, 1e-2)  # v settles
            start = p.clone()
            for i in range(20):
                g = (torch.full((1,), 20.0) if i == 19 else torch.zeros(1)) if burst else \
                    torch.ones(1)
                opt.update([(0, 1, False)], p, g, m, v, step, 1e-2)
            moves[(freeze, burst)] = (p - start).item()
    assert abs(moves[(1, True)] - moves[(1, False)]) < 1e-3 * abs(moves[(1, False)])
    assert abs(moves[(None, True)]) < 0.5 * abs(moves[(None, False)])

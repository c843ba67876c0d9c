"""GaLore AdamW (Zhao et al. 2024): the AdamW moments of a matrix live in a rank-r subspace of its
gradient. For the blocks' linear weights (2-D parameters that take weight decay) each step
projects the gradient G (rows, cols) onto P, the top r singular vectors of a gradient taken at
the last refresh, on the smaller side as galore-torch's `std` projection does:

    rows >= cols: P = Vh[:r]     (r, cols),  R = G P^T  (rows, r),  back(N) = N P
    rows <  cols: P = U[:, :r]   (rows, r),  R = P^T G  (r, cols),  back(N) = P N

runs Adam on R (moments of R's shape), and applies lr * scale * back(N) to the fp32 master
after decoupled weight decay (torch.optim.AdamW's order and eps placement; galore-torch decays
after the step and adds eps to sqrt(v) before bias correction). P is refreshed from the step's
gradient, already accumulated and clipped, at steps 1, 1 + update_every, ...; it is state,
stored and checkpointed like the moments. With rank >= min(rows, cols) the projection is full
rank (r = min(rows, cols)): Adam then runs in the gradient's singular basis, not elementwise.
Every other parameter takes plain AdamW (the fused kernel).

The projection is torch.linalg.svd of the fp32 gradient on the CPU, deterministic for a given
input, so the flat optimizer and the per-parameter `GaLoreAdamW` (reference trainer) agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch.optim.adam import adam

from tierlm.memory.layout import FlatLayout, ParamSlot
from tierlm.optim.flat import FlatOptimizer, StateSlot, device_steps, step_count

if TYPE_CHECKING:
    from tierlm.config import OptimConfig


def projected(shape: tuple[int, ...], decay: bool) -> bool:
    """Which parameters GaLore projects: matrices that take weight decay (linear weights)."""
    return len(shape) == 2 and decay


def _rank(shape: tuple[int, ...], rank: int) -> int:
    return min(rank, *shape)


def projection_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    rows, cols = shape
    r = _rank(shape, rank)
    return (r, cols) if rows >= cols else (rows, r)


def moment_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    rows, cols = shape
    r = _rank(shape, rank)
    return (rows, r) if rows >= cols else (r, cols)


def new_projection(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """P from the SVD of `grad` (rows, cols): Vh[:r] (r, cols) or U[:, :r] (rows, r)."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    r = _rank(tuple(grad.shape), rank)
    return vh[:r] if grad.shape[0] >= grad.shape[1] else u[:, :r]


def project(grad: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    return grad @ proj.T if grad.shape[0] >= grad.shape[1] else proj.T @ grad


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() and t.data_ptr() % 64 == 0 else t.clone(
        memory_format=torch.contiguous_format)


def galore_step(w: torch.Tensor, g: torch.Tensor, proj: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, count: float, *, lr: float, betas: tuple[float, float],
                eps: float, weight_decay: float, scale: float, rank: int, update_every: int
                ) -> None:
    """One GaLore AdamW step on matrix `w` (rows, cols) in place, step number `count` (from 1);
    `proj`, `exp_avg`, `exp_avg_sq` are its state, in their own shapes."""
    beta1, beta2 = betas
    # LAPACK/BLAS results can depend on a buffer's alignment, and a parameter's part of a flat
    # buffer starts anywhere: copy such parts to fresh (64-byte aligned) memory, so the flat
    # optimizer and its twin hand the kernels the same bits at the same alignment
    g = _aligned(g)
    if (count - 1) % update_every == 0:
        proj.copy_(new_projection(g, rank))
    p = _aligned(proj)
    r = project(g, p)
    # Adam on the projected gradient in torch's fused kernel (one pass; the eager operations
    # made eight, each a parallel region): run on a zero buffer with lr 1 and no decay, it
    # leaves minus Adam's direction there, m_hat / (sqrt(v_hat) + eps)
    neg_direction = torch.zeros_like(r)
    # the count before this step, made on r's device by a fill (no copy from host memory)
    before = torch.full((), count - 1.0, dtype=torch.float32, device=r.device)
    adam([neg_direction], [r], [exp_avg], [exp_avg_sq], [], [before],
         fused=True, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
         lr=1.0, weight_decay=0.0, eps=eps, maximize=False)
    # decay, back-projection and update in one GEMM: w = (1 - lr wd) w - lr scale back(direction)
    a, b = (neg_direction, p) if w.shape[0] >= w.shape[1] else (p, neg_direction)
    w.addmm_(a, b, beta=1 - lr * weight_decay, alpha=lr * scale)


def adamw_step(ws: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
               vs: list[torch.Tensor], step: torch.Tensor, *, lr: float,
               betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Plain AdamW on the unprojected parameters: torch's fused kernel, on copies of the
    counter (the caller advances it)."""
    if not ws:
        return
    adam(ws, gs, ms, vs, [], device_steps(step, ws[0].device, len(ws)), fused=True,
         decoupled_weight_decay=True, amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
         weight_decay=weight_decay, eps=eps, maximize=False)


class FlatGaLoreAdamW(FlatOptimizer):
    """GaLore AdamW over a segment's flat state (see the module's comment): beta1, beta2, eps
    and weight decay from `cfg`; rank, refresh interval and scale as given, else from `cfg`
    (`--optim.galore_rank`, `--optim.galore_update_every`, `--optim.galore_scale`). Not
    rangeable (`align = 0`): the projection needs a whole matrix's gradient."""

    name = "GaLoreAdamW"
    align = 0
    # bench/optimizer_update.py, 16.8M params, rank 128, a step without a refresh: 0.10x fused
    # AdamW's params/s (two GEMMs a matrix, 4 * rank flops per parameter); the SVD refresh every
    # galore_update_every steps comes on top and is not counted
    cpu_cost = 10.0

    def __init__(self, cfg: OptimConfig, *, rank: int | None = None,
                 update_every: int | None = None, scale: float | None = None) -> None:
        super().__init__(cfg)
        rank = cfg.galore_rank if rank is None else rank
        update_every = cfg.galore_update_every if update_every is None else update_every
        scale = cfg.galore_scale if scale is None else scale
        if rank < 1 or update_every < 1:
            raise ValueError("--optim.galore_rank and --optim.galore_update_every must be >= 1")
        self.rank, self.update_every, self.scale = rank, update_every, scale
        self.betas = (cfg.beta1, cfg.beta2)

        def proj_numel(p: ParamSlot) -> int:
            return math.prod(projection_shape(p.shape, rank)) if projected(p.shape, p.decay) else 0

        def proj_shape(p: ParamSlot) -> tuple[int, ...]:
            return projection_shape(p.shape, rank) if projected(p.shape, p.decay) else (0,)

        def moment_numel(p: ParamSlot) -> int:
            if projected(p.shape, p.decay):
                return math.prod(moment_shape(p.shape, rank))
            return p.numel

        def moment_shape_of(p: ParamSlot) -> tuple[int, ...]:
            return moment_shape(p.shape, rank) if projected(p.shape, p.decay) else p.shape

        # not averaged across ranks: under delayed sync each rank projects its own gradient,
        # and moments in different bases do not average
        self.slots = (
            StateSlot("projection", numel_of=proj_numel, shape_of=proj_shape, block=0,
                      average=False),
            StateSlot("exp_avg", numel_of=moment_numel, shape_of=moment_shape_of, block=0,
                      average=False),
            StateSlot("exp_avg_sq", numel_of=moment_numel, shape_of=moment_shape_of, block=0,
                      average=False),
        )

    def update_range(self, layout: FlatLayout, lo: int, master: torch.Tensor,
                     grad: torch.Tensor, state: dict[str, torch.Tensor],
                     steps: list[torch.Tensor], lr: float) -> None:
        if lo != 0 or master.numel() != layout.numel:
            raise ValueError("GaLoreAdamW updates whole segments (align = 0): the engine must "
                             "not chunk its update")
        w = layout.views(master)
        g = layout.views(grad)
        proj, m, v = (s.views(layout, state[s.name]) for s in self.slots)
        eps = self.cfg.eps
        for (_, _, decay), step in zip(layout.groups(), steps, strict=True):
            wd = self.cfg.weight_decay if decay else 0.0
            plain = []
            for p in layout.slots:
                if p.decay != decay:
                    continue
                if projected(p.shape, p.decay):
                    galore_step(w[p.name], g[p.name], proj[p.name], m[p.name], v[p.name],
                                step_count(step) + 1, lr=lr, betas=self.betas, eps=eps,
                                weight_decay=wd, scale=self.scale, rank=self.rank,
                                update_every=self.update_every)
                else:
                    plain.append(p.name)
            adamw_step([w[n] for n in plain], [g[n] for n in plain], [m[n] for n in plain],
                       [v[n] for n in plain], step, lr=lr, betas=self.betas, eps=eps,
                       weight_decay=wd)


class GaLoreAdamW(torch.optim.Optimizer):
    """The per-parameter twin of `FlatGaLoreAdamW` for the reference trainer. A group with
    `galore=True` projects its 2-D parameters (give it the weight-decay group, whose members
    are the linear weights); other parameters take plain fused AdamW."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, rank: int = 128, update_every: int = 200,
                 scale: float = 0.25) -> None:
        if rank < 1 or update_every < 1:
            raise ValueError("--optim.galore_rank and --optim.galore_update_every must be >= 1")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay, "galore": False})
        self.rank, self.update_every, self.scale = rank, update_every, scale

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            hyper = {"lr": group["lr"], "betas": group["betas"], "eps": group["eps"],
                     "weight_decay": group["weight_decay"]}
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                low = group["galore"] and projected(tuple(p.shape), True)
                if not st:
                    shape = moment_shape(tuple(p.shape), self.rank) if low else p.shape
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros(shape)
                    st["exp_avg_sq"] = torch.zeros(shape)
                    if low:
                        st["projection"] = torch.zeros(projection_shape(tuple(p.shape),
                                                                        self.rank))
                if low:
                    galore_step(p, p.grad, st["projection"], st["exp_avg"], st["exp_avg_sq"],
                                float(st["step"]) + 1, scale=self.scale, rank=self.rank,
                                update_every=self.update_every, **hyper)
                else:
                    adamw_step([p], [p.grad], [st["exp_avg"]], [st["exp_avg_sq"]], st["step"],
                               **hyper)
                st["step"].add_(1)

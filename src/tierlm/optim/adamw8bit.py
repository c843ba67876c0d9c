"""AdamW with both moments stored in 8 bits, blockwise (Dettmers et al. 2022, as bitsandbytes and
torchao do): each parameter is cut into blocks of 256 consecutive elements from its start (the
last may be short), and each block keeps one fp32 scale per moment, its absolute maximum.

Maps. The first moment is stored as a signed code q in [-127, 127] with m = s sign(q) (q/127)^4,
the second as q in [0, 255] with v = s (q/255)^4: linear codes of |m|^(1/4) and v^(1/4). Power
maps spend the codes on small values as the dynamic-tree maps of bitsandbytes/torchao do, but
quantise in closed form (two square roots and a round) instead of a search over a table, and
reach lower: the smallest nonzero v is (1/255)^4 of its block's maximum, where the dynamic tree's
unsigned map stops near 1e-7 and rounds smaller v to zero, which a moment m of the same element
then divides by eps. `bench/optimizer_maps.py` measures the pairs (linear, power 2/3/4,
dynamic tree for m; linear, sqrt, power 4/6, dynamic tree for v) by the error of the update
they lead to after 20 steps: power 4 for both is at or near the smallest.

Step. As in torchao and bitsandbytes, the moments are dequantised, advanced in fp32, requantised
for storage, and the parameter update uses the fp32 moments of this step; the fp32 master stays
exact. Decay is decoupled (torch.optim.AdamW's order: decay, then the Adam step).

The flat optimizer and the per-parameter `AdamW8bit` run the same block kernel; since blocks are
per parameter, they give identical results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from tierlm.memory.layout import FlatLayout, ParamSlot
from tierlm.optim import native as kernels  # `native` names the flag below
from tierlm.optim.flat import FlatOptimizer, StateSlot, params_in, step_count

if TYPE_CHECKING:
    from tierlm.config import OptimConfig

BLOCK = 256
_CHUNK_BLOCKS = 4096  # eager kernel: 1M elements per call, so its temporaries stay in cache
_TINY = torch.finfo(torch.float32).tiny


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _scales(p: ParamSlot) -> int:
    return n_blocks(p.numel)


def _param_shape(p: ParamSlot) -> tuple[int, ...]:
    return p.shape


def _hyper(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           count: float) -> torch.Tensor:
    """The kernel's scalars, in fp32 as both kernels use them (the order is the C source's)."""
    bc1 = 1.0 - beta1**count
    bc2 = 1.0 - beta2**count
    return torch.tensor(
        [1.0 - beta1, 1.0 - beta2, beta1, beta2, 1.0 - lr * weight_decay, lr / bc1,
         1.0 / math.sqrt(bc2), eps, 1.0 / 127**4, 1.0 / 255**4],
        dtype=torch.float32,
    )


def dequantize_exp_avg(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(nb, B) int8 codes and (nb,) block scales -> the fp32 first moment, s sign(q) (q/127)^4."""
    q = codes.float()
    return torch.copysign(q.square().square_(), q).mul_(scale.unsqueeze(1) * (1.0 / 127**4))


def dequantize_exp_avg_sq(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(nb, B) uint8 codes and (nb,) block scales -> the fp32 second moment, s (q/255)^4."""
    q = codes.float().square_()
    return q.square_().mul_(scale.unsqueeze(1) * (1.0 / 255**4))


def _eager_blocks(p: torch.Tensor, g: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
                  sm: torch.Tensor, sv: torch.Tensor, h: torch.Tensor) -> None:
    """The block kernel in PyTorch ops on (nb, B) views (scales (nb,)), in place: the C
    kernel's operations in its order, each a separate fp32 rounding (no lerp or alpha-add,
    whose CPU kernels fuse a multiply-add)."""
    w1, w2, b1, b2, decay, step, ibc2, eps = h[:8]
    m = dequantize_exp_avg(qm, sm).mul_(b1).add_(g * w1)
    v = dequantize_exp_avg_sq(qv, sv).mul_(b2).add_(g.square().mul_(w2))
    am = m.abs().amax(1)
    av = v.amax(1)
    sm.copy_(am)
    sv.copy_(av)
    r = v.sqrt_()  # v is not needed again: the codes and the update read sqrt(v)
    fm = am.clamp_min(_TINY).sqrt_().sqrt_().reciprocal_().mul_(127.0).unsqueeze(1)
    qm.copy_(torch.copysign(m.abs().sqrt_().sqrt_().mul_(fm), m).round_())
    fv = av.clamp_min(_TINY).sqrt_().sqrt_().reciprocal_().mul_(255.0).unsqueeze(1)
    qv.copy_(r.sqrt().mul_(fv).round_())
    p.mul_(decay).sub_(m.mul_(step).div_(r.mul_(ibc2).add_(eps)))


def step_span(p: torch.Tensor, g: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor,
              sm: torch.Tensor, sv: torch.Tensor, h: torch.Tensor, native: bool) -> None:
    """One step on a span of whole blocks: flat p, g, qm, qv of n elements whose blocks start
    at the span's start (only the last may be short), sm/sv their ceil(n/256) scales. The C
    kernel runs CPU tensors; the eager one anything else (a segment resident on the GPU), with
    `h` (CPU, fp32) as scalars."""
    fn = kernels.kernel() if native and p.device.type == "cpu" else None
    if fn is not None:
        kernels.run(fn, p, g, qm, qv, sm, sv, h)
        return
    n = p.numel()
    full = n // BLOCK
    for i in range(0, full, _CHUNK_BLOCKS):
        j = min(i + _CHUNK_BLOCKS, full)
        a, b = i * BLOCK, j * BLOCK
        _eager_blocks(p[a:b].view(-1, BLOCK), g[a:b].view(-1, BLOCK), qm[a:b].view(-1, BLOCK),
                      qv[a:b].view(-1, BLOCK), sm[i:j], sv[i:j], h)
    if n > full * BLOCK:  # the short last block
        a = full * BLOCK
        _eager_blocks(p[a:].view(1, -1), g[a:].view(1, -1), qm[a:].view(1, -1),
                      qv[a:].view(1, -1), sm[full:], sv[full:], h)


_CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}

SLOTS = (
    StateSlot("exp_avg", torch.int8, shape_of=_param_shape, average=False),
    StateSlot("exp_avg_sq", torch.uint8, shape_of=_param_shape, average=False),
    StateSlot("exp_avg_scale", numel_of=_scales, block=BLOCK, average=False),
    StateSlot("exp_avg_sq_scale", numel_of=_scales, block=BLOCK, average=False),
)


class FlatAdamW8bit(FlatOptimizer):
    """8-bit AdamW over a segment's flat state (see the module's comment): beta1, beta2, eps and
    weight decay from `cfg`. `native=False` runs the eager PyTorch kernel (the same operations,
    several times slower)."""

    name = "AdamW8bit"
    # the per-parameter twin's state keys, so either runtime resumes the other's checkpoint
    slots = SLOTS
    align = BLOCK
    # bench/optimizer_update.py, 16.8M params: 0.74-0.75x fused AdamW's params/s (C kernel)
    cpu_cost = 1.35

    def __init__(self, cfg: OptimConfig, *, native: bool = True) -> None:
        super().__init__(cfg)
        self.native = native

    def update_range(self, layout: FlatLayout, lo: int, master: torch.Tensor,
                     grad: torch.Tensor, state: dict[str, torch.Tensor],
                     steps: list[torch.Tensor], lr: float) -> None:
        hi = lo + master.numel()
        groups = [decay for _, _, decay in layout.groups()]
        scale_at = dict(zip((p.name for p in layout.slots), SLOTS[2].offsets(layout),
                            strict=True))
        s0 = SLOTS[2].range(layout, lo, hi)[0]
        for p, a, b, first_scale in _spans(params_in(layout, lo, hi), scale_at):
            g = groups.index(p.decay)
            # h stays in host memory on any device: the eager kernel's operations take its
            # elements as CPU scalars, where a copy to the device would block until the
            # device's queue drained, once per span
            h = _hyper(lr, self.cfg.beta1, self.cfg.beta2, self.cfg.eps,
                       self.cfg.weight_decay if p.decay else 0.0, step_count(steps[g]) + 1)
            e0, e1 = a - lo, b - lo
            k0 = first_scale - s0
            k1 = k0 + n_blocks(b - a)
            step_span(master[e0:e1], grad[e0:e1], state["exp_avg"][e0:e1],
                      state["exp_avg_sq"][e0:e1], state["exp_avg_scale"][k0:k1],
                      state["exp_avg_sq_scale"][k0:k1], h, self.native)


def _spans(parts: list[tuple[ParamSlot, int, int]], scale_at: dict[str, int]
           ) -> list[tuple[ParamSlot, int, int, int]]:
    """Merge consecutive parameter parts into spans one kernel call can take: same
    weight-decay group, and every part but the last ending on a whole block of its parameter
    (then the next part's first block follows in the scale buffers too). Each span is
    (its first parameter, a, b, the scale index of its first block)."""
    out: list[tuple[ParamSlot, int, int, int]] = []
    for p, a, b in parts:
        first = scale_at[p.name] + (a - p.offset) // BLOCK
        if out:
            q, qa, qb, qs = out[-1]
            if q.decay == p.decay and qb == a and (qb - qa) % BLOCK == 0:
                out[-1] = (q, qa, b, qs)
                continue
        out.append((p, a, b, first))
    return out


class AdamW8bit(torch.optim.Optimizer):
    """The per-parameter twin of `FlatAdamW8bit` for the reference trainer: the same kernel over
    each parameter's flat view (blocks are per parameter, so the results are identical). Groups
    take `weight_decay` as torch.optim.AdamW's do."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, native: bool = True) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.native = native

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError("AdamW8bit updates fp32 parameters: use --precision fp32 "
                                     "or bf16 autocast (fp32 master) with --opt AdamW8bit")
                st = self.state[p]
                if not st:
                    nb = n_blocks(p.numel())
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    # codes in the parameter's shape, as the flat slots store them in checkpoints
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.int8)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.uint8)
                    st["exp_avg_scale"] = torch.zeros(nb, device=p.device)
                    st["exp_avg_sq_scale"] = torch.zeros(nb, device=p.device)
                for name, dtype in _CODE_DTYPES.items():
                    # loaders (torch.optim.Optimizer.load_state_dict, the reference trainer's
                    # resume) cast state to the parameter's dtype; the codes are small
                    # integers, so the round trip through fp32 is exact
                    if st[name].dtype != dtype:
                        st[name] = st[name].to(dtype)
                h = _hyper(group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                           float(st["step"]) + 1).to(p.device)
                flat = p.view(-1)
                step_span(flat, p.grad.reshape(-1).contiguous(), st["exp_avg"].view(-1),
                          st["exp_avg_sq"].view(-1), st["exp_avg_scale"], st["exp_avg_sq_scale"],
                          h, self.native)
                st["step"].add_(1)

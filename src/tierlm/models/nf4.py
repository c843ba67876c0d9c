"""NF4 with double quantisation (the QLoRA paper, Dettmers et al. 2023): --finetune qlora's base.

**The code.** NF4 has 16 levels in [-1, 1]: quantiles of the standard normal, so that a weight
drawn from a normal distribution and divided by its block's absolute maximum is equally likely
to fall in each level's bin, with an exact zero. With Phi^-1 the normal quantile function and
`delta = 1/2 (1/30 + 1/32)` (the paper's offset: between the outermost quantiles of 15 and of
16 equal bins), the levels are

    positive:  Phi^-1(p) for the 9 values p = linspace(1 - delta, 1/2, 9) but the last (8 levels)
    negative: -Phi^-1(p) for the 8 values p = linspace(1 - delta, 1/2, 8) but the last (7 levels)
    and 0,

all divided by the largest magnitude (so the ends are -1 and 1): 8 positive, 7 negative, zero.
`nf4_levels()` computes them.

**Blocks.** A tensor (its numel a multiple of 64) is cut into blocks of 64 consecutive
elements; each block keeps its absolute maximum `s` (its first-level scale) and every element
`x` becomes the index of the level nearest to `x / s` (4 bits, two per byte, the first of a
pair in the high nibble). The rounding error of an element is at most half the gap between the
two levels around `x / s`, times `s`.

**Double quantisation.** The first-level scales (one fp32 per 64 weights, 0.5 bits per weight)
are quantised again: their mean over the tensor is subtracted (they are all positive), and the
centred scales are cut into groups of 256, each stored as int8 (round to nearest, symmetric,
127 steps) with one fp32 step per group: `s_hat = q * step + mean`. That is 8 bits per 64 weights
plus 32 per 16384, about 0.127 bits per weight; the scale of a block is off by at most half its
group's step. A weight is then 4 bits + ~0.127: ~0.516 bytes per parameter.

**Bytes of one tensor** (`nf4_nbytes`): [mean: fp32][steps: fp32 per group][scales: int8 per
block][codes: 4 bits per element], so every fp32 read is 4-byte aligned. Decoding
(`dequantise`) gives `level[code] * s_hat` in the compute dtype, block by block (vectorised over
the blocks), on whatever device holds the bytes.

**In the runtime.** `quantised_names` picks the tensors: the base weight of every layer LoRA
wraps (`<module>.base_layer.weight`), as QLoRA quantises the frozen linear layers; norms,
biases, embeddings and the head stay fp32. A segment holding any of them gets an `NF4Format`
(the `compute_format` of runtime/state.py): its state on its tier (device, host RAM or a disk
file) is these bytes and nothing else (no fp32 master), quantised at load from the fp32 weights
the streamed loader hands over, one tensor at a time (tierlm.models.frozen); the stream moves
the bytes, and each action decodes the segment's weights on the device right before it runs
(`NF4Format.flat`): into fp32, or in a bf16 run straight into bf16 (a bf16 compute copy, norms
fp32, read as a streamed bf16 copy is). bf16(decoded) is what a reference computes from the
round trip cast to bf16: the same fp32 product rounded once.
"""

from __future__ import annotations

import torch
from torch import nn

from tierlm.memory.layout import FlatLayout

BLOCK = 64  # weights per first-level (absmax) scale
SCALE_BLOCK = 256  # first-level scales per second-level (fp32) step
ALIGN = 16  # every tensor's bytes start 16-byte aligned in a segment's copy


def nf4_levels(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 NF4 levels, ascending (see the module docstring for the formula)."""
    delta = 0.5 * (1 / 30 + 1 / 32)
    q = torch.special.ndtri
    pos = q(torch.linspace(1 - delta, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -q(torch.linspace(1 - delta, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos])
    return (levels / levels.abs().max()).sort().values.to(dtype)


_LEVELS = nf4_levels()
_MIDPOINTS = (_LEVELS[1:] + _LEVELS[:-1]) / 2  # the bins' edges: nearest level by bucketize


def _parts(numel: int) -> tuple[int, int, int]:
    """(blocks, scale groups, bytes) of one tensor of `numel` elements."""
    if numel % BLOCK:
        raise ValueError(f"NF4 quantises tensors whose size is a multiple of {BLOCK}, "
                         f"not {numel}")
    blocks = numel // BLOCK
    groups = -(-blocks // SCALE_BLOCK)
    return blocks, groups, 4 + 4 * groups + blocks + numel // 2


def nf4_nbytes(numel: int) -> int:
    """Bytes of one quantised tensor of `numel` elements (a multiple of 64)."""
    return _parts(numel)[2]


def quantise(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the NF4 bytes of `x` (any shape, numel a multiple of 64; read as fp32) into `out`
    (uint8, `nf4_nbytes(x.numel())` long, on the CPU) and return it."""
    blocks, groups, nbytes = _parts(x.numel())
    if out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"quantise: out must be {nbytes} uint8, got {out.numel()} {out.dtype}")
    w = x.detach().reshape(blocks, BLOCK).float()  # (blocks, 64)
    absmax = w.abs().amax(dim=1)  # (blocks,)
    u = w / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)  # in [-1, 1]
    idx = torch.bucketize(u, _MIDPOINTS).to(torch.uint8).view(blocks, BLOCK // 2, 2)
    mean = absmax.mean()
    centred = torch.zeros(groups * SCALE_BLOCK)
    centred[:blocks] = absmax - mean
    centred = centred.view(groups, SCALE_BLOCK)
    step = centred.abs().amax(dim=1) / 127  # (groups,)
    q = torch.where(step.unsqueeze(1) > 0, centred / step.clamp_min(1e-38).unsqueeze(1),
                    torch.zeros(())).round_().clamp_(-127, 127).to(torch.int8)
    mean_b, step_b, scales_b, codes_b = _views(out, blocks, groups)
    mean_b.copy_(mean.reshape(1))
    step_b.copy_(step)
    scales_b.copy_(q.reshape(-1)[:blocks])
    codes_b.copy_((idx[..., 0] << 4 | idx[..., 1]).reshape(-1))
    return out


def _views(buf: torch.Tensor, blocks: int, groups: int):
    """(mean fp32 (1,), steps fp32 (groups,), scales int8 (blocks,), codes uint8) of `buf`."""
    a, b = 4, 4 + 4 * groups
    return (buf[:a].view(torch.float32), buf[a:b].view(torch.float32),
            buf[b : b + blocks].view(torch.int8), buf[b + blocks :])


def dequantised_scales(buf: torch.Tensor, numel: int) -> torch.Tensor:
    """Each block's first-level scale as stored (after double quantisation), fp32 (blocks,)."""
    blocks, groups, _ = _parts(numel)
    mean, step, scales, _ = _views(buf, blocks, groups)
    return scales.float() * step.repeat_interleave(SCALE_BLOCK)[:blocks] + mean


def dequantise(buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The `numel` weights NF4 bytes `buf` hold (flat, `dtype`, on `buf`'s device), written into
    `out` when given."""
    blocks, groups, _ = _parts(numel)
    codes = _views(buf, blocks, groups)[3]
    idx = torch.stack([codes >> 4, codes & 15], dim=-1).view(blocks, BLOCK).long()
    levels = _LEVELS.to(buf.device)
    w = levels[idx] * dequantised_scales(buf, numel).unsqueeze(1)  # (blocks, 64)
    if out is None:
        return w.reshape(-1).to(dtype)
    out.view(blocks, BLOCK).copy_(w)
    return out


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """`x` quantised to NF4 and decoded again (fp32, `x`'s shape): the values a QLoRA base
    computes with."""
    buf = torch.empty(nf4_nbytes(x.numel()), dtype=torch.uint8)
    return dequantise(quantise(x, buf), x.numel()).view(x.shape)


def quantised_names(model: nn.Module) -> set[str]:
    """The parameters --finetune qlora stores in NF4: the base weight of every layer LoRA wraps
    (peft's `<module>.base_layer.weight`), where its size is a multiple of 64."""
    return {n for n, p in model.named_parameters()
            if n.endswith(".base_layer.weight") and not p.requires_grad and p.numel() % BLOCK == 0}


def quantise_in_place(model: nn.Module) -> None:
    """Replace each of `quantised_names`' values by its NF4 round trip (a model whose weights
    are in RAM: the reference trainer's, and the base a test or peft loads the adapter on)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(quantised_names(model)):
            p = params[name]
            p.copy_(round_trip(p.detach().float()).to(p.dtype))


# -- a segment's base as NF4 bytes ---------------------------------------------------------


class NF4Format:
    """A frozen segment's weights as one byte buffer: NF4 for the `quantised` parameters, fp32
    for the rest, each entry 16-byte aligned. Stands where runtime/state.py's `compute_format`
    stands: `nbytes`, `flat` (the decoded weights of one action) and `views`.

    `kinds`: the dtype each slot computes in (tierlm.precision.streaming.slot_kinds); None or
    all fp32: decoded into one flat fp32 buffer read through plain views. Otherwise (a bf16
    run) decoded into a `ComputeFormat` buffer of those kinds (the NF4 weights straight into
    bf16, the norms fp32), read through its views as a streamed bf16 compute copy is."""

    def __init__(self, layout: FlatLayout, quantised: set[str],
                 kinds: list[str] | None = None) -> None:
        from tierlm.precision.streaming import ComputeFormat

        self.layout = layout
        self.entries: list[tuple[int, int, int, bool]] = []  # (offset, numel, byte offset, nf4)
        nbytes = 0
        for slot in layout.slots:
            nf4 = slot.name in quantised
            self.entries.append((slot.offset, slot.numel, nbytes, nf4))
            size = nf4_nbytes(slot.numel) if nf4 else 4 * slot.numel
            nbytes += -(-size // ALIGN) * ALIGN
        self.nbytes = nbytes
        self.kinds = ["nf4" if nf4 else "fp32" for *_, nf4 in self.entries]
        mixed = kinds is not None and any(k != "fp32" for k in kinds)
        self.decoded = ComputeFormat(layout, kinds) if mixed else None
        # the buffer each action decodes into (outside the ledger)
        self.decoded_nbytes = 4 * layout.numel if self.decoded is None else self.decoded.nbytes

    def encode_slot(self, k: int, values: torch.Tensor, wire: torch.Tensor) -> None:
        """Write slot `k`'s fp32 `values` (its numel) into the copy `wire` (uint8, host)."""
        _, numel, at, nf4 = self.entries[k]
        if nf4:
            quantise(values, wire[at : at + nf4_nbytes(numel)])
        else:
            wire[at : at + 4 * numel].view(torch.float32).copy_(values.reshape(-1))

    def encode(self, master: torch.Tensor, wire: torch.Tensor) -> None:
        """Fill `wire` from the segment's flat fp32 weights `master`."""
        for k, (offset, numel, _, _) in enumerate(self.entries):
            self.encode_slot(k, master.narrow(0, offset, numel), wire)

    def _decode_into(self, copy: torch.Tensor, dst_of) -> None:
        """Decode every entry of `copy` into `dst_of(k, offset, numel)` (a flat tensor of the
        entry's decoded dtype): NF4 entries block by block, fp32 ones copied (rounded to the
        destination's dtype)."""
        for k, (offset, numel, at, nf4) in enumerate(self.entries):
            dst = dst_of(k, offset, numel)
            if nf4:
                dequantise(copy[at : at + nf4_nbytes(numel)], numel, dst.dtype, out=dst)
            else:
                dst.copy_(copy[at : at + 4 * numel].view(torch.float32))

    def flat(self, copy: torch.Tensor) -> torch.Tensor:
        """The segment's flat weights decoded from its copy `copy` (uint8, on the device) into
        a buffer of this action's own."""
        if self.decoded is None:
            out = torch.empty(self.layout.numel, dtype=torch.float32, device=copy.device)
            self._decode_into(copy, lambda k, offset, numel: out.narrow(0, offset, numel))
            return out
        fmt = self.decoded
        buf = torch.empty(fmt.nbytes, dtype=torch.uint8, device=copy.device)
        self._decode_into(copy, lambda k, offset, numel: fmt.slot_view(buf, k))
        return fmt.flat(buf)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return (self.layout.views(flat) if self.decoded is None else self.decoded.views(flat))

    def decode(self, copy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values the matmuls read, by parameter name, widened to fp32 (CPU tensors of
        their own)."""
        copy = copy.to("cpu")
        if self.decoded is None:
            return {n: v.clone() for n, v in self.layout.views(self.flat(copy)).items()}
        buf = torch.empty(self.decoded.nbytes, dtype=torch.uint8)
        self._decode_into(copy, lambda k, offset, numel: self.decoded.slot_view(buf, k))
        return self.decoded.decode(buf)


def bits_per_parameter(numel: int) -> float:
    """NF4 bits per weight of a tensor of `numel` elements, scales included."""
    return 8 * nf4_nbytes(numel) / numel


__all__ = ["BLOCK", "SCALE_BLOCK", "NF4Format", "bits_per_parameter", "dequantise",
           "dequantised_scales", "nf4_levels", "nf4_nbytes", "quantise", "quantise_in_place",
           "quantised_names", "round_trip"]

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
the streamed loader hands over, one tensor at a time (tierlm.runtime.frozen); the stream moves
the bytes, and each action decodes the segment's weights on the device right before it runs
(`NF4Format.flat`): into fp32, or in a bf16 run straight into bf16 (a bf16 compute copy, norms
fp32, read as a streamed bf16 copy is). bf16(decoded) is what a reference computes from the
round trip cast to bf16: the same fp32 product rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.memory.layout import FlatLayout
from tierlm.precision.linear import PrecisionLinear, _mm_fp32_out
from tierlm.precision.streaming import _typed

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


DECODE_CHUNK = 1 << 22  # most weights decoded per pass: bounds the index and fp32 temporaries
MIN_DECODE_CHUNK = 1 << 16  # fewest (a smaller tensor is one pass)


def _chunk(numel: int) -> int:
    """Weights per decode pass of a tensor of `numel`: a quarter of it (so the temporaries stay
    below 1.5 bytes a weight), whole blocks, within [MIN_DECODE_CHUNK, DECODE_CHUNK]; few
    passes, as each is a handful of kernel launches on a GPU."""
    return max(MIN_DECODE_CHUNK, min(DECODE_CHUNK, numel // 4 // BLOCK * BLOCK))


def decode_traffic_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes `dequantise` reads and writes in memory to decode `numel` weights into `dtype`
    (the planner's decode time: a memory-bound pass): per weight, the codes (1/2) widened to
    int32 indices (written 2, read 2), the levels gathered (written 4), scaled in place (read
    and written 4 each), and for bf16 the fp32 products read (4) and rounded into the output
    (2): 16.5 bytes a weight into fp32, 22.5 into bf16. The block scales (1/16) are left out."""
    per_two = 33 if dtype == torch.float32 else 45  # bytes per two weights
    return numel * per_two // 2


def _pairs(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the two levels each code byte holds (high nibble first), on `device`."""
    table = _PAIRS.get(device)
    if table is None:
        byte = torch.arange(256)
        table = _PAIRS[device] = torch.stack([_LEVELS[byte >> 4], _LEVELS[byte & 15]],
                                             dim=1).to(device)
    return table


_PAIRS: dict[torch.device, torch.Tensor] = {}


def dequantise(buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The `numel` weights NF4 bytes `buf` hold (flat, `dtype`, on `buf`'s device), written into
    `out` when given: `level[code] * s_hat` in fp32, rounded once to `dtype`.

    Decoded a chunk of weights at a time (`_chunk`), so besides `out` and the block scales (fp32,
    1/16 of a byte per weight) the decode holds only one chunk's int32 code indices and, for a
    dtype other than fp32, its fp32 products (`decode_workspace_nbytes`)."""
    blocks, groups, _ = _parts(numel)
    codes = _views(buf, blocks, groups)[3]
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=buf.device)
    scales = dequantised_scales(buf, numel)  # (blocks,)
    table = _pairs(buf.device)
    chunk = _chunk(numel)
    for lo in range(0, numel, chunk):
        n = min(chunk, numel - lo)
        idx = codes[lo // 2 : (lo + n) // 2].int()  # (n/2,) one index per byte
        dst = out.narrow(0, lo, n)
        w = dst if dst.dtype == torch.float32 else torch.empty(n, device=buf.device)
        torch.index_select(table, 0, idx, out=w.view(-1, 2))  # (n/2, 2) levels
        del idx
        w.view(-1, BLOCK).mul_(scales[lo // BLOCK : (lo + n) // BLOCK].unsqueeze(1))
        if w is not dst:
            dst.copy_(w)
    return out


def decode_workspace_nbytes(numel: int, dtype: torch.dtype) -> int:
    """At most the bytes `dequantise` holds at once for one tensor of `numel` weights decoded
    into `dtype`: the output, the block scales and the temporaries that make them (three fp32
    arrays of one value per block, padded to whole scale groups), and one chunk's int32 indices
    (and fp32 products, unless `dtype` is fp32)."""
    _, groups, _ = _parts(numel)
    chunk = min(numel, _chunk(numel))
    products = 0 if dtype == torch.float32 else 4 * chunk
    return numel * dtype.itemsize + 3 * 4 * groups * SCALE_BLOCK + 2 * chunk + products


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


# -- a linear layer that decodes its own NF4 weight ------------------------------------------

NF4_BYTES = "_nf4"
"""Suffix of the buffer (and of the runtime's view name) that carries a weight's NF4 bytes:
`q_proj.base_layer.weight` -> `q_proj.base_layer.weight_nf4`."""


class _NF4LinearFn(torch.autograd.Function):
    """y = layer(x) with the frozen weight decoded from its NF4 bytes just before the matmul
    and dropped after it. The backward (the gradient of the input; the weight takes none)
    decodes it again from the saved bytes: a graph keeps ~0.52 bytes per weight, views of the
    segment's NF4 copy (rebuilt from the backward's copy: activations/saved.py), never the
    decoded weight."""

    @staticmethod
    def forward(ctx, x, nf4, bias, layer):
        out = layer.matmul(x, layer.decoded(nf4), bias)
        ctx.save_for_backward(nf4)
        ctx.layer, ctx.x_dtype = layer, x.dtype
        return out

    @staticmethod
    def backward(ctx, gout):
        (nf4,) = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            gx = ctx.layer.input_grad(gout, ctx.layer.decoded(nf4), ctx.x_dtype)
        return gx, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear layer (peft's base layer of a --finetune qlora target) that reads its
    weight as NF4 bytes and decodes it per matmul, forward and backward: the device holds one
    decoded weight at a time (`decode_workspace_nbytes`), never a segment's.

    Replaces `source` (an `nn.Linear`, GPT-2's `Conv1D`, or a `PrecisionLinear` computing in
    fp32 or bf16) and keeps its `weight` and `bias` Parameters, so names, checkpoints and the
    runtime's views are unchanged. The runtime's `functional_call` swaps the bytes in as the
    buffer `weight_nf4` and an fp32 stand-in without values as `weight`; without bytes (a model
    whose weights are in RAM) the layer is `source` itself. The math is `source`'s on the
    decoded weight: fp32 as `F.linear`, bf16 as tierlm.precision.linear's `Bf16Linear` (bf16
    operands; the gradient of an fp32 input summed in fp32)."""

    def __init__(self, source: nn.Module) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.weight = source.weight
        self.register_parameter("bias", source.bias)
        self.compute = source.compute.name if isinstance(source, PrecisionLinear) else "plain"
        if self.compute not in ("plain", "fp32", "bf16"):
            raise ValueError(f"--finetune qlora: the base layer computes in {self.compute}; "
                             "use --precision bf16 or fp32")
        self.transposed = isinstance(source, Conv1D) or getattr(source, "transposed", False) is True
        self.stored_shape = tuple(source.weight.shape)  # (in, out) when transposed
        out_dim, in_dim = self.stored_shape[::-1] if self.transposed else self.stored_shape
        self.in_features, self.out_features = int(in_dim), int(out_dim)
        self._source = (source,)  # not a submodule: its parameters are this layer's
        self.register_buffer("weight" + NF4_BYTES, None, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """What the weight is decoded into."""
        return torch.bfloat16 if self.compute == "bf16" else torch.float32

    def decoded(self, nf4: torch.Tensor) -> torch.Tensor:
        """The weight from its NF4 bytes, (out, in) (a transposed view for a Conv1D)."""
        numel = self.in_features * self.out_features
        w = _decode_weight(nf4, numel, self.dtype).view(self.stored_shape)
        return w.t() if self.transposed else w

    def matmul(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.compute == "plain":
            return F.linear(x, w, bias)
        with torch.autocast(x.device.type, enabled=False):
            if self.compute == "fp32":
                return F.linear(x.float(), w, None if bias is None else bias.float())
            return F.linear(x.to(torch.bfloat16), w,
                            None if bias is None else bias.to(torch.bfloat16))

    def input_grad(self, gout: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype
                   ) -> torch.Tensor:
        """d loss / d x for an output gradient `gout`: what autograd of `matmul` computes."""
        if self.compute != "bf16":
            return (gout.reshape(-1, gout.shape[-1]).mm(w)
                    .view(*gout.shape[:-1], w.shape[1]).to(x_dtype))
        with torch.autocast(gout.device.type, enabled=False):
            g = gout.to(torch.bfloat16)
            if x_dtype == torch.bfloat16:  # as Bf16Linear: rounded to the input's bf16
                return g @ w
            g2 = g.reshape(-1, g.shape[-1])
            return _mm_fp32_out(g2, w).reshape(*g.shape[:-1], w.shape[1]).to(x_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nf4 = self.weight_nf4
        if nf4 is None:
            return self._source[0](x)
        if self.bias is not None and self.bias.requires_grad:
            raise ValueError("--finetune qlora keeps the base's biases frozen (--lora.bias none)")
        if self.compute == "plain" and torch.is_autocast_enabled(x.device.type):
            raise ValueError("--finetune qlora under autocast needs the precision policy's "
                             "layers (--precision bf16 applies them)")
        return _NF4LinearFn.apply(x, nf4, self.bias, self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, nf4 -> {self.compute}"


def _decode_weight(nf4: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One layer's weight decoded for one matmul (a test wraps this to count them alive)."""
    return dequantise(nf4, numel, dtype)


def swap_nf4_layers(model: nn.Module, quantised: set[str]) -> int:
    """Replace the layer owning each of `quantised` (`<module>.base_layer.weight`) by an
    `NF4Linear` of it, in place; returns how many were replaced."""
    swapped = 0
    for name in sorted(quantised):
        owner, _, leaf = name.rpartition(".base_layer.")
        if leaf != "weight":
            raise ValueError(f"not a LoRA base weight: {name}")
        wrapper = model.get_submodule(owner)
        if not isinstance(wrapper.base_layer, NF4Linear):
            wrapper.base_layer = NF4Linear(wrapper.base_layer)
            swapped += 1
    return swapped


# -- a segment's base as NF4 bytes ---------------------------------------------------------


class NF4Format:
    """A frozen segment's weights as one byte buffer: NF4 for the `quantised` parameters, fp32
    for the rest, each entry 16-byte aligned. Stands where runtime/state.py's `compute_format`
    stands: `nbytes`, `flat` and `views`.

    Nothing is decoded per segment: an action's flat weights are the copy itself; its views
    read the fp32 entries where they lie and hand each quantised weight's `NF4Linear` its bytes
    (the layer decodes them per matmul). `kinds`: the dtype each slot computes in
    (tierlm.precision.streaming.slot_kinds; None: all fp32): what a quantised weight decodes
    into (bf16 or fp32), and the rounding `decode` applies to read the base's values."""

    def __init__(self, layout: FlatLayout, quantised: set[str],
                 kinds: list[str] | None = None) -> None:
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
        self.compute_kinds = list(kinds) if kinds is not None else ["fp32"] * len(self.entries)
        # the largest decode a matmul of this segment holds at once (outside the ledger)
        self.decoded_nbytes = max(
            (decode_workspace_nbytes(numel, _DTYPE[kind])
             for (_, numel, _, nf4), kind in zip(self.entries, self.compute_kinds, strict=True)
             if nf4), default=0)

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

    def flat(self, copy: torch.Tensor) -> torch.Tensor:
        """The segment's flat weights for an action: its copy `copy` (uint8, on the device)."""
        return copy

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> tensor for one run of the segment on its copy `flat`: fp32 entries as fp32
        views of it; a quantised weight as a stand-in without values (stride 0) and its NF4
        bytes under `name + NF4_BYTES`, the buffer its `NF4Linear` reads."""
        out = {}
        for slot, (_, numel, at, nf4) in zip(self.layout.slots, self.entries, strict=True):
            if nf4:
                out[slot.name] = _typed(flat, 0, torch.float32, ()).as_strided(
                    slot.shape, (0,) * len(slot.shape))
                out[slot.name + NF4_BYTES] = flat[at : at + nf4_nbytes(numel)]
            else:
                out[slot.name] = _typed(flat, at, torch.float32, slot.shape)
        return out

    def decode(self, copy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values the matmuls read, by parameter name, widened to fp32 (CPU tensors of
        their own): a quantised weight decoded as its layer decodes it, an fp32 entry of a bf16
        layer (a bias) rounded to bf16 as the layer rounds it."""
        copy = copy.to("cpu")
        out = {}
        for slot, (_, numel, at, nf4), kind in zip(self.layout.slots, self.entries,
                                                   self.compute_kinds, strict=True):
            dtype = _DTYPE[kind]
            if nf4:
                values = dequantise(copy[at : at + nf4_nbytes(numel)], numel, dtype)
            else:
                values = copy[at : at + 4 * numel].view(torch.float32).to(dtype)
            out[slot.name] = values.float().view(slot.shape).clone()
        return out


_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bits_per_parameter(numel: int) -> float:
    """NF4 bits per weight of a tensor of `numel` elements, scales included."""
    return 8 * nf4_nbytes(numel) / numel


__all__ = ["BLOCK", "DECODE_CHUNK", "NF4_BYTES", "SCALE_BLOCK", "NF4Format", "NF4Linear",
           "bits_per_parameter", "decode_traffic_bytes", "decode_workspace_nbytes", "dequantise",
           "dequantised_scales", "nf4_levels", "nf4_nbytes", "quantise", "quantise_in_place",
           "quantised_names", "round_trip", "swap_nf4_layers"]

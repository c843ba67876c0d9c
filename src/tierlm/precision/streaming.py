"""Compute copies in the precision each weight computes in, for the tiered runtime's stream.

Without this the runtime streams a segment's fp32 master weights to the device (4 bytes per
parameter). With a precision policy applied, every weight crosses in the dtype its matmul
reads: fp32 for sensitive layers (norms, embeddings, head), bf16 for bf16 layers, and E4M3 plus
one fp32 scale for fp8 layers, so an fp8 block crosses at ~1 byte per parameter and a bf16 one
at ~2. The copy is encoded on the host after every optimizer update (on the update worker, the
tier that updates them) and decoded into the segment's fp32 device slot on arrival.

Decoding loses nothing the compute would have kept: autocast rounds fp32 weights to bf16 the
same way, and an fp8 layer re-quantises the decoded E4M3 values with the same (power-of-two)
dynamic scale, which reproduces them bit for bit. The device slot still holds fp32 (4 bytes per
parameter); only the host copy and the host-to-device traffic shrink.

Only host-resident state streams this way; disk-resident segments still stream fp32 from their
master file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierlm.memory.layout import FlatLayout
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.precision.formats import E4M3
from tierlm.precision.linear import PrecisionLinear
from tierlm.precision.scaling import dynamic_scale

WIRE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": E4M3.dtype}
ALIGN = 4  # every entry starts 4-byte aligned, so the fp32 views of the buffer are legal


@dataclass(frozen=True)
class _Entry:
    offset: int  # in the flat fp32 layout (elements)
    numel: int
    kind: str  # fp32 | bf16 | e4m3
    byte_offset: int  # in the wire buffer
    scale_index: int = -1  # e4m3: index of its 1/scale among the buffer's trailing fp32s


class ComputeFormat:
    """Per slot of one segment's flat layout, the dtype its compute copy crosses in."""

    def __init__(self, layout: FlatLayout, kinds: list[str]) -> None:
        self.kinds = kinds
        entries, nbytes, scales = [], 0, 0
        for slot, kind in zip(layout.slots, kinds, strict=True):
            entries.append(_Entry(slot.offset, slot.numel, kind, nbytes,
                                  scales if kind == "e4m3" else -1))
            scales += kind == "e4m3"
            nbytes += -(-slot.numel * WIRE_DTYPE[kind].itemsize // ALIGN) * ALIGN
        self.entries: list[_Entry] = entries
        self.scales_offset = nbytes
        self.n_scales = scales
        self.nbytes = nbytes + 4 * scales

    def encode(self, master: torch.Tensor, wire: torch.Tensor) -> None:
        """Fill the host copy `wire` (uint8) from the flat fp32 `master`."""
        inv = wire[self.scales_offset : self.nbytes].view(torch.float32)
        for e in self.entries:
            src = master.narrow(0, e.offset, e.numel)
            dst = self._slice(wire, e)
            if e.kind != "e4m3":
                dst.copy_(src)
                continue
            scale = dynamic_scale(E4M3, src.abs().amax())  # what the layer would choose
            dst.copy_((src * scale).clamp_(-E4M3.max, E4M3.max))
            inv[e.scale_index] = scale.reciprocal()

    def decode(self, store: Store, wire: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the host `wire` to the device and expand it into the fp32 slot `dst`."""
        inv = wire[self.scales_offset : self.nbytes].view(torch.float32).tolist()
        if self.n_scales:  # the scales cross too (as kernel arguments)
            store.ledger.record_move(Link.H2D, 4 * self.n_scales)
        for e in self.entries:
            out = dst.narrow(0, e.offset, e.numel)
            store.wait(store.to_device(out, self._slice(wire, e)))
            if e.kind == "e4m3":
                out.mul_(inv[e.scale_index])

    @staticmethod
    def _slice(wire: torch.Tensor, e: _Entry) -> torch.Tensor:
        size = e.numel * WIRE_DTYPE[e.kind].itemsize
        return wire[e.byte_offset : e.byte_offset + size].view(WIRE_DTYPE[e.kind])


def _slot_kinds(model: nn.Module, layout: FlatLayout) -> list[str]:
    """The wire dtype of every slot: what the module that owns the parameter computes in."""
    kind_of: dict[int, str] = {}
    for m in model.modules():
        if isinstance(m, PrecisionLinear):
            name = m.compute.name
            kind_of[id(m.weight)] = {"fp8": "e4m3", "bf16": "bf16"}.get(name, "fp32")
            if m.bias is not None:  # added in the output dtype: bf16 unless fp32 compute
                kind_of[id(m.bias)] = "fp32" if name == "fp32" else "bf16"
    params = dict(model.named_parameters())
    return [kind_of.get(id(params[s.name]), "fp32") for s in layout.slots]


class ComputeCopies:
    """The tiered runtime's compute copies for one model: built at setup, refreshed after every
    update of a host-resident segment, decoded by `WireLoad`. A model without precision layers
    (fp32 runs) gets none, and the runtime streams its fp32 masters as before."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = any(isinstance(m, PrecisionLinear) for m in model.modules())

    def attach(self, store: Store, st) -> None:
        """Give segment state `st` (runtime/state.py) its host compute copy, if it streams
        from host RAM and any weight of it crosses in less than fp32."""
        if not self.enabled or st.tier != Tier.HOST:
            return
        kinds = _slot_kinds(self.model, st.layout)
        if all(k == "fp32" for k in kinds):
            return
        self._realloc(store, st, kinds)
        self.refresh(store, st, st.master)
        if st.device_weights is not None and st.device_weights is not st.master:
            WireLoad(store, st).finish(st.device_weights)  # resident: the same numbers

    def refresh(self, store: Store, st, master: torch.Tensor) -> None:
        """Re-encode after an update (layers switched from fp8 to bf16 change the format)."""
        if getattr(st, "wire", None) is None:
            return
        kinds = _slot_kinds(self.model, st.layout)
        if kinds != st.compute_format.kinds:
            store.free(Tier.HOST, TensorClass.COMPUTE, st.wire)
            self._realloc(store, st, kinds)
        st.compute_format.encode(master, st.wire)

    @staticmethod
    def _realloc(store: Store, st, kinds: list[str]) -> None:
        st.compute_format = ComputeFormat(st.layout, kinds)
        st.wire = store.alloc(Tier.HOST, TensorClass.COMPUTE, st.compute_format.nbytes,
                              dtype=torch.uint8)


class WireLoad:
    """A streamed segment's weights from its host compute copy (the `HostLoad` of
    runtime/state.py, at the compute copy's size)."""

    def __init__(self, store: Store, st) -> None:
        self.store, self.st = store, st

    def finish(self, dst: torch.Tensor) -> None:
        self.st.compute_format.decode(self.store, self.st.wire, dst)

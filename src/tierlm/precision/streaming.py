"""Compute copies in the precision each weight computes in, for the tiered runtime's stream.

Without this the runtime streams a segment's fp32 master weights to the device (4 bytes per
parameter) and computes from an fp32 device copy. With a precision policy applied, every weight
is kept, moved and held on the device in the dtype its matmul reads: fp32 for sensitive layers
(norms, embeddings, head), bf16 for bf16 layers, and E4M3 plus one fp32 scale for fp8 layers,
so an fp8 block costs ~1 byte per parameter and a bf16 one ~2, in host RAM (or on disk), over
host-to-device and in its device slot. The copy is encoded after every optimizer update, on
the update worker: into host RAM for host-resident state, into its own file
(`<segment>/compute.bin`) for disk-resident state, which the stream then reads instead of the
fp32 master.

The device copy is one byte buffer (`ComputeFormat.nbytes`). A segment's actions read it
through `ComputeFormat.views`: fp32 entries as fp32 views; bf16 and E4M3 entries as fp32
stand-ins without values, with the stored values (and an E4M3 entry's scale) beside them under
suffixed names (tierlm.precision.linear.STORED) that the layers' matmuls read instead: bf16
directly, E4M3 with its scale (`torch._scaled_mm` where the device runs
it; the emulation widens the stored values to fp32 per matmul). Gradients flow through the
stand-ins in fp32 into the segment's flat fp32 gradient, exactly as from an fp32 copy.

Nothing differs from an fp32 copy decoded from the same bytes: autocast (and the bf16 layers)
round fp32 weights to bf16 the same way, and an fp8 layer would re-quantise the decoded E4M3
values with the same power-of-two dynamic scale (or twice it, where rounding took the amax down
to a power of two), which gives the same products bit for bit (tests/precision/test_streaming.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierlm.memory.device import AFTER_COMPUTE
from tierlm.memory.layout import FlatLayout
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.precision.formats import E4M3
from tierlm.precision.linear import INV_SCALE, STORED, PrecisionLinear
from tierlm.precision.scaling import dynamic_scale

WIRE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": E4M3.dtype}
# Every entry starts 16-byte aligned: its views are legal for any of the dtypes, and an E4M3
# weight can be an operand of the fp8 GEMM (cuBLASLt wants 16-byte aligned pointers).
ALIGN = 16


@dataclass(frozen=True)
class _Entry:
    offset: int  # in the flat fp32 layout (elements)
    numel: int
    kind: str  # fp32 | bf16 | e4m3
    byte_offset: int  # in the compute copy
    scale_index: int = -1  # e4m3: index of its 1/scale among the copy's trailing fp32s


def _typed(buf: torch.Tensor, byte_offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A `dtype` view of `shape` at `byte_offset` bytes into the memory `buf` starts at."""
    start = buf.storage_offset() * buf.element_size() + byte_offset
    out = torch.empty(0, dtype=dtype, device=buf.device)
    return out.set_(buf.untyped_storage(), start // dtype.itemsize, tuple(shape))


class _Values(torch.autograd.Function):
    """An fp32 entry of the compute copy as a parameter: its values from the copy, its gradient
    to the flat stand-in's slice (the copy itself is bytes and takes no gradient)."""

    @staticmethod
    def forward(ctx, sink, values):
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ComputeFormat:
    """Per slot of one segment's flat layout, the dtype its compute copy holds it in."""

    def __init__(self, layout: FlatLayout, kinds: list[str]) -> None:
        self.layout = layout
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
        """Fill the compute copy `wire` (uint8, on the host) from the flat fp32 `master`."""
        for k, e in enumerate(self.entries):
            self.encode_slot(k, master.narrow(0, e.offset, e.numel), wire)

    def encode_slot(self, k: int, values: torch.Tensor, wire: torch.Tensor) -> None:
        """Write slot `k`'s fp32 `values` (its numel) into the compute copy `wire` (a frozen
        base is encoded one tensor at a time as the loader hands it over)."""
        e = self.entries[k]
        src = values.reshape(-1)
        dst = self._slice(wire, e)
        if e.kind != "e4m3":
            dst.copy_(src)
            return
        scale = dynamic_scale(E4M3, src.abs().amax())  # what the layer would choose
        dst.copy_((src * scale).clamp_(-E4M3.max, E4M3.max))
        wire[self.scales_offset : self.nbytes].view(torch.float32)[e.scale_index] = \
            scale.reciprocal()

    def decode(self, copy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values the compute copy `copy` (uint8) holds, by parameter name, widened to fp32
        (E4M3 entries times their scale's reciprocal): what the matmuls read."""
        inv = copy[self.scales_offset : self.nbytes].view(torch.float32)
        out = {}
        for slot, e in zip(self.layout.slots, self.entries, strict=True):
            values = self._slice(copy, e).float()
            if e.kind == "e4m3":
                values = values * inv[e.scale_index]
            out[slot.name] = values.view(slot.shape)
        return out

    def flat(self, copy: torch.Tensor) -> torch.Tensor:
        """The flat fp32 weights a segment's actions take from its device compute copy `copy`
        (uint8): a tensor of the flat layout's shape on `copy`'s memory with no values of its
        own (stride 0), so that autograd hands it the flat fp32 gradient, and the views of the
        copy that a graph saves count as the segment's weights (activations/saved.py)."""
        return _typed(copy, 0, torch.float32, ()).as_strided((self.layout.numel,), (0,))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> parameter tensor for one run of the segment on `flat` (from `flat()`, or a
        leaf detached from it): fp32 entries read the copy; bf16 and E4M3 entries are fp32
        stand-ins, their stored values (and 1/scale) under `name + STORED` (`+ INV_SCALE`),
        the buffers the layers read them from (tierlm.precision.linear). Every gradient lands
        in `flat`'s fp32 gradient, through one split as `FlatLayout.views`'."""
        inv = _typed(flat, self.scales_offset, torch.float32, (self.n_scales,))
        parts = flat.split_with_sizes([s.numel for s in self.layout.slots])
        out = {}
        for slot, e, part in zip(self.layout.slots, self.entries, parts, strict=True):
            sink = part.view(slot.shape)
            values = _typed(flat, e.byte_offset, WIRE_DTYPE[e.kind], slot.shape)
            if e.kind == "fp32":
                out[slot.name] = _Values.apply(sink, values)
                continue
            out[slot.name], out[slot.name + STORED] = sink, values
            if e.kind == "e4m3":
                out[slot.name + INV_SCALE] = inv[e.scale_index]
        return out

    def slot_view(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Slot `k`'s stored values in the copy `buf` (uint8), flat, in its stored dtype."""
        return self._slice(buf, self.entries[k])

    @staticmethod
    def _slice(wire: torch.Tensor, e: _Entry) -> torch.Tensor:
        size = e.numel * WIRE_DTYPE[e.kind].itemsize
        return wire[e.byte_offset : e.byte_offset + size].view(WIRE_DTYPE[e.kind])


def slot_kinds(model: nn.Module, layout: FlatLayout) -> list[str]:
    """The compute dtype of every slot: what the module that owns the parameter computes in."""
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
    """The tiered runtime's compute copies for one model: built at setup for every segment whose
    state is off the device, refreshed after every update, held in the devices' slots. A model
    without precision layers (fp32 runs) gets none, and the runtime streams and computes from
    its fp32 masters as before."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = any(isinstance(m, PrecisionLinear) for m in model.modules())

    def copy_nbytes(self, layout: FlatLayout) -> int | None:
        """Bytes of the compute copy a segment with flat layout `layout` keeps while its state
        is off the device (`choose_format`'s rule); None where every weight computes in fp32
        and the segment streams its master."""
        kinds = slot_kinds(self.model, layout) if self.enabled else ["fp32"]
        if all(k == "fp32" for k in kinds):
            return None
        return ComputeFormat(layout, kinds).nbytes

    def layout_nbytes(self, layout: FlatLayout) -> int:
        """Bytes of the device copy of a segment with flat layout `layout` whose state is off
        the device (4 per parameter where every weight computes in fp32)."""
        copy = self.copy_nbytes(layout)
        return layout.numel * 4 if copy is None else copy

    def nbytes(self, st) -> int:
        """Device bytes of segment `st`'s weights once its compute copy is next refreshed."""
        return st.numel * 4 if st.compute_format is None else self.layout_nbytes(st.layout)

    def choose_format(self, st) -> None:
        """Before segment state `st` (runtime/state.py) is placed: give it a compute-copy
        format if its state is off the device and any weight of it computes in less than fp32
        (`init_state` then leaves a resident segment's device copy to `attach`)."""
        if not self.enabled or st.tier == Tier.DEVICE:
            return
        kinds = slot_kinds(self.model, st.layout)
        if any(k != "fp32" for k in kinds):
            st.compute_format = ComputeFormat(st.layout, kinds)

    def attach(self, store: Store, st) -> None:
        """After `init_state`: fill the compute copy of `st`, in host RAM (`st.wire`) or in its
        file on disk, and a resident segment's device copy from it."""
        if st.compute_format is None:
            return
        if st.tier == Tier.HOST:
            self._alloc_wire(store, st)
            st.compute_format.encode(st.master, st.wire)
            source = st.wire
        else:
            master = store.alloc(Tier.HOST, TensorClass.STAGING, st.numel)
            store.read_file(st.file("master"), master).result()
            source = self._write_file(store, st, master, keep=True)
            store.free(Tier.HOST, TensorClass.STAGING, master)
        if st.placement.resident:
            st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE,
                                            st.compute_format.nbytes, dtype=torch.uint8)
            copied = store.to_device(st.device_weights, source, st.seg.name)
            store.wait(copied)
            store.wait_host(copied, st.seg.name)  # the copy has read `source` before it goes
        if st.tier == Tier.DISK:
            store.free(Tier.HOST, TensorClass.STAGING, source)

    def refresh(self, store: Store, st, master: torch.Tensor) -> None:
        """Re-encode from the whole flat `master` after an update (the fp8 scale is per tensor,
        from the amax of all of it). Layers switched from fp8 to bf16 change the format."""
        if st.compute_format is None:
            return
        kinds = slot_kinds(self.model, st.layout)
        if kinds != st.compute_format.kinds:
            st.compute_format = ComputeFormat(st.layout, kinds)
            if st.tier == Tier.HOST:
                store.free(Tier.HOST, TensorClass.COMPUTE, st.wire)
                self._alloc_wire(store, st)
        if st.tier == Tier.HOST:
            st.compute_format.encode(master, st.wire)
        else:
            self._write_file(store, st, master)

    @staticmethod
    def _alloc_wire(store: Store, st) -> None:
        # what the segment's H2D copies read: pinned (runtime.state.pinned_class)
        st.wire = store.alloc(Tier.HOST, TensorClass.COMPUTE, st.compute_format.nbytes,
                              dtype=torch.uint8, pinned=True)

    @staticmethod
    def _write_file(store: Store, st, master: torch.Tensor, *, keep: bool = False):
        """Encode into host staging and write the segment's compute file; the staging buffer is
        returned to the caller with `keep`, freed otherwise."""
        staging = store.alloc(Tier.HOST, TensorClass.STAGING, st.compute_format.nbytes,
                              dtype=torch.uint8)
        st.compute_format.encode(master, staging)
        store.write_file(st.file("compute"), staging, TensorClass.COMPUTE).result()
        if keep:
            return staging
        store.free(Tier.HOST, TensorClass.STAGING, staging)
        return None


class WireLoad:
    """A streamed segment's weights from its host compute copy: one H2D copy of its bytes (the
    `HostLoad` of runtime/state.py, at the compute copy's size)."""

    def __init__(self, store: Store, st) -> None:
        self.store, self.st = store, st
        self.started, self.copied = False, None

    def start(self, dst: torch.Tensor, after) -> None:
        self.started = True
        self.copied = self.store.to_device(dst, self.st.wire, self.st.seg.name, after=after)

    def finish(self, dst: torch.Tensor) -> None:
        if not self.started:
            self.start(dst, AFTER_COMPUTE)
        self.store.wait(self.copied, self.st.seg.name)

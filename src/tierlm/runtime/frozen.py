"""A LoRA run's frozen base held in the form its matmuls read, and nothing else.

A frozen base is never updated, so it needs no fp32 master beside its compute copy: every
segment whose base has a weight computing below fp32 keeps only that copy on its tier (device,
host RAM or a disk file), written once at load, one tensor at a time, from the fp32 weights the
streamed loader hands over; the stream moves it and each action reads it. Segments without such
a weight (the embedding, the head, whose layers the precision policy keeps in fp32) keep their
fp32 master as under fp32, which is then the copy they stream.

The copy's format follows `--finetune` and the run's precision (`base_format`):

- `bf16` (`--finetune lora --precision bf16`): tierlm.precision.streaming's `ComputeFormat`,
  each weight in the dtype its layer computes in (the blocks' linear layers bf16, norms fp32),
  read through the same fp32 stand-ins a full-parameter bf16 run's streamed copy is: 2 bytes
  per weight of the blocks' linear layers, on every tier.
- `nf4` (`--finetune qlora`): tierlm.precision.nf4's `NF4Format` (~0.52 bytes per quantised
  weight, the rest fp32). Nothing is decoded per segment: each quantised weight's layer is
  swapped for an `NF4Linear` (`swap_nf4_layers`) that decodes its own weight per matmul, into
  fp32 (an fp32 run) or bf16 (a bf16 run), forward and backward.

Stands where ComputeCopies stands in the engine (`init_state` replaces runtime.state's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tierlm.memory.layout import FlatLayout
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.precision.linear import PrecisionLinear
from tierlm.precision.nf4 import BLOCK, NF4Format, NF4Linear, quantised_names, swap_nf4_layers
from tierlm.precision.streaming import ComputeFormat, slot_kinds
from tierlm.runtime.state import init_state

BASE_FORMATS = ("fp32", "bf16", "nf4")


class FrozenBase:
    """The tiered runtime's frozen base for `base_format` bf16 or nf4 (fp32: the engine's
    ComputeCopies, which leaves every segment its fp32 master)."""

    def __init__(self, model: nn.Module, base_format: str) -> None:
        if base_format not in ("bf16", "nf4"):
            raise ValueError(f"FrozenBase holds a bf16 or nf4 base, not {base_format!r}")
        if all(p.requires_grad for p in model.parameters()):
            raise ValueError(f"a {base_format} frozen base needs frozen parameters (a model "
                             "apply_lora wrapped)")
        self.model = model
        self.base_format = base_format
        self.enabled = False  # formats never change after load: the stream cache keeps its size
        self.precision_layers = any(isinstance(m, PrecisionLinear) for m in model.modules())
        self.quantised = quantised_names(model) if base_format == "nf4" else set()
        if base_format == "nf4" and not self.quantised:
            raise ValueError("--finetune qlora: no LoRA-wrapped weight to quantise (a multiple "
                             f"of {BLOCK} elements); check --lora.targets")
        if base_format == "bf16" and not self.precision_layers:
            raise ValueError("a bf16 frozen base needs the precision policy applied first "
                             "(tierlm.precision.prepare_precision under --precision bf16)")
        # what each parameter computes in, read off the precision layers before NF4 layers
        # replace the quantised weights' ones
        params = [(n, tuple(p.shape), True) for n, p in model.named_parameters()]
        self._kind_of = dict(zip([n for n, _, _ in params],
                                 slot_kinds(model, FlatLayout(params)), strict=True))
        for name, m in model.named_modules():  # swapped already (a second engine on `model`)
            if isinstance(m, NF4Linear):
                kind = "bf16" if m.compute == "bf16" else "fp32"
                self._kind_of[f"{name}.weight"] = kind
                if m.bias is not None:
                    self._kind_of[f"{name}.bias"] = kind
        if base_format == "nf4":
            swap_nf4_layers(model, self.quantised)

    def _kinds(self, layout: FlatLayout) -> list[str] | None:
        return ([self._kind_of[s.name] for s in layout.slots] if self.precision_layers
                else None)

    def format_of(self, layout: FlatLayout) -> ComputeFormat | NF4Format | None:
        """The copy a segment of flat layout `layout` holds its base in (None: its fp32
        master)."""
        kinds = self._kinds(layout)
        if self.base_format == "nf4":
            names = {s.name for s in layout.slots}
            return NF4Format(layout, self.quantised, kinds) if names & self.quantised else None
        return ComputeFormat(layout, kinds) if any(k != "fp32" for k in kinds) else None

    def copy_nbytes(self, layout: FlatLayout) -> int | None:
        """Bytes of the copy a segment of flat layout `layout` holds its base in (None: its
        fp32 master)."""
        fmt = self.format_of(layout)
        return None if fmt is None else fmt.nbytes

    def decoded_nbytes(self, layout: FlatLayout) -> int:
        """Bytes one matmul of this segment decodes its weight into at most, outside the ledger
        (an NF4 base's largest quantised weight, and the decode's temporaries; a bf16 copy is
        read where it lies)."""
        fmt = self.format_of(layout)
        return fmt.decoded_nbytes if isinstance(fmt, NF4Format) else 0

    def nbytes(self, st) -> int:
        return st.device_nbytes()

    def choose_format(self, st) -> None:
        st.compute_format = self.format_of(st.layout)

    def attach(self, store: Store, st) -> None:
        """Nothing: `init_state` put the bytes in place."""

    def refresh(self, store: Store, st, master: torch.Tensor) -> None:
        """Nothing: the base is never updated."""

    def init_state(self, store: Store, st, fill: Callable[[torch.Tensor, int], object],
                   optim_device: torch.device, ranges: list[tuple[int, int]]) -> None:
        """runtime.state.init_state for a frozen segment: its copy on its tier, encoded at load
        one parameter at a time (`fill(out, lo)` packs the fp32 elements from `lo`), so host
        RAM holds one tensor in fp32 on the way, never the segment."""
        fmt = st.compute_format
        if fmt is None:
            init_state(store, st, fill, optim_device, ranges)
            return
        host = st.tier == Tier.HOST
        # host: the copy the stream crosses from, pinned (runtime.state.pinned_class); else
        # staging on its way to the file, pageable
        wire = store.alloc(Tier.HOST, TensorClass.COMPUTE if host else TensorClass.STAGING,
                           fmt.nbytes, dtype=torch.uint8, pinned=host)
        wire.zero_()  # alignment padding: the file's bytes are deterministic
        largest = max(slot.numel for slot in st.layout.slots)
        values = store.alloc(Tier.HOST, TensorClass.STAGING, largest)
        for k, slot in enumerate(st.layout.slots):
            fmt.encode_slot(k, fill(values[: slot.numel], slot.offset), wire)
        store.free(Tier.HOST, TensorClass.STAGING, values)
        if host:
            st.wire = wire  # streamed from here (runtime.state.WireLoad)
        elif st.tier == Tier.DISK:
            store.write_file(st.file("compute"), wire, TensorClass.COMPUTE).result()
        if st.tier == Tier.DEVICE or st.placement.resident:
            st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, fmt.nbytes,
                                            dtype=torch.uint8)
            store.wait(store.to_device(st.device_weights, wire, st.seg.name))
            if st.device_weights.device.type == "cuda":
                torch.cuda.current_stream(st.device_weights.device).synchronize()
        if not host:
            store.free(Tier.HOST, TensorClass.STAGING, wire)

    def weights(self, store: Store, st) -> dict[str, torch.Tensor]:
        """The values frozen segment `st`'s matmuls read, by parameter name (CPU, fp32)."""
        fmt = st.compute_format
        if st.device_weights is not None:
            copy = st.device_weights.to("cpu")
        elif st.wire is not None:
            copy = st.wire
        else:
            staging = store.alloc(Tier.HOST, TensorClass.STAGING, fmt.nbytes, dtype=torch.uint8)
            store.read_file(st.file("compute"), staging).result()
            copy = staging.clone()
            store.free(Tier.HOST, TensorClass.STAGING, staging)
        return {n: v.clone() for n, v in fmt.decode(copy).items()}

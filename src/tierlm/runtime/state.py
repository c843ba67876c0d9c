"""Per-segment model state in flat buffers on its tier, and the ways to read and refresh it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.models.adapters import Segment
from tierlm.optim.flat_adamw import new_step_counter
from tierlm.precision.streaming import ComputeFormat, WireLoad

STATE_COPIES = ("master", "exp_avg", "exp_avg_sq")
# the ledger class of each state copy's file on the disk tier
_FILE_CLASS = {
    "master": TensorClass.MASTER,
    "exp_avg": TensorClass.OPTIM,
    "exp_avg_sq": TensorClass.OPTIM,
}


InitialWeights = Callable[[Segment], Mapping[str, torch.Tensor]]
"""Where a segment's initial weights come from: segment -> {parameter name: tensor} (any dtype,
on the CPU). The runtime looks each name up once while packing the segment's flat buffer and
writes the segment to its tier before asking for the next, so a lazy mapping
(tierlm.models.load.CheckpointWeights) keeps one segment in memory, never the model."""


def module_weights(seg: Segment) -> Mapping[str, torch.Tensor]:
    """The default source: the weights the model's parameters hold."""
    return {name: p.detach() for name, p, _ in seg.params}


@dataclass
class SegmentState:
    index: int
    seg: Segment
    layout: FlatLayout
    placement: SegmentPlacement
    # Flat fp32 buffers on `placement.state_tier` (None while they live in files on disk).
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    steps: list[torch.Tensor] = field(default_factory=list)  # one counter per optimizer group
    device_weights: torch.Tensor | None = None  # resident compute copy (or the master itself)
    device_stale: bool = False  # the resident copy predates the last update
    grad_written: bool = False  # disk: this step's gradient file holds a partial sum
    # The compute copy in the precision each weight computes in (tierlm.precision.streaming):
    # its format (None: the segment streams and computes from its fp32 master) and, for host
    # state, the host copy (disk state keeps it in its `compute` file).
    compute_format: ComputeFormat | None = None
    wire: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def tier(self) -> Tier:
        return self.placement.state_tier

    def file(self, copy: str) -> str:
        return f"{self.seg.name}/{copy}.bin"

    def device_nbytes(self) -> int:
        """Bytes of the segment's weights on the device: its compute copy, or fp32."""
        return self.numel * 4 if self.compute_format is None else self.compute_format.nbytes

    def flat(self, copy: torch.Tensor) -> torch.Tensor:
        """The flat weights the segment's actions take, from its device copy `copy` (a stream
        slot's bytes, or the resident copy)."""
        if self.compute_format is None:
            return copy.view(torch.float32)
        return self.compute_format.flat(copy)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter tensors of one run of the segment on `flat` (or a leaf of it)."""
        if self.compute_format is None:
            return self.layout.views(flat)
        return self.compute_format.views(flat)


def init_state(
    store: Store, st: SegmentState, fill: Callable[[torch.Tensor], object],
    optim_device: torch.device,
) -> None:
    """Place the segment's initial weights and zeroed optimizer state. `fill(out)` writes the
    packed fp32 weights into the flat buffer `out` (the master on its tier, or the staging
    buffer the disk tier writes from), so no second copy of the segment is made on the way."""
    n = st.numel
    st.steps = [new_step_counter(optim_device) for _ in st.layout.groups()]
    if st.tier == Tier.DISK:
        initial = store.alloc(Tier.HOST, TensorClass.STAGING, n)
        fill(initial)
        store.write_file(st.file("master"), initial, TensorClass.MASTER).result()
    else:
        initial = st.master = store.alloc(st.tier, TensorClass.MASTER, n)
        fill(initial)
        st.exp_avg = store.zeros(st.tier, TensorClass.OPTIM, n)
        st.exp_avg_sq = store.zeros(st.tier, TensorClass.OPTIM, n)
        st.grad = store.zeros(st.tier, TensorClass.GRAD, n)
    if st.tier == Tier.DEVICE:
        st.device_weights = st.master  # fp32: the master is what the matmuls read
    elif st.placement.resident and st.compute_format is None:  # else: ComputeCopies.attach
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)
        st.device_weights.copy_(initial)
    if st.tier == Tier.DISK:
        staging = initial.zero_()
        store.write_file(st.file("exp_avg"), staging, TensorClass.OPTIM).result()
        store.write_file(st.file("exp_avg_sq"), staging, TensorClass.OPTIM).result()
        # reserve the gradient file now, so the disk tier's size is known up front
        store.write_file(st.file("grad"), staging, TensorClass.GRAD).result()
        store.free(Tier.HOST, TensorClass.STAGING, staging)


class HostLoad:
    """Streamed weights whose source is the host master: one H2D copy."""

    def __init__(self, store: Store, st: SegmentState) -> None:
        self.store, self.st = store, st

    def finish(self, dst: torch.Tensor) -> None:
        self.store.wait(self.store.to_device(dst.view(torch.float32), self.st.master,
                                             self.st.seg.name))


class DiskLoad:
    """Streamed weights read from the segment's file into host staging, then one H2D copy: its
    compute copy (bf16/fp8 runs) or else its fp32 master. The disk read starts at construction
    so prefetching overlaps it with compute."""

    def __init__(self, store: Store, st: SegmentState) -> None:
        self.store = store
        self.name = st.seg.name
        if st.compute_format is None:
            self.staging = store.alloc(Tier.HOST, TensorClass.STAGING, st.numel)
            self.future = store.read_file(st.file("master"), self.staging)
        else:
            self.staging = store.alloc(Tier.HOST, TensorClass.STAGING,
                                       st.compute_format.nbytes, dtype=torch.uint8)
            self.future = store.read_file(st.file("compute"), self.staging)

    def finish(self, dst: torch.Tensor) -> None:
        self.future.result()
        self.store.wait(self.store.to_device(dst.view(self.staging.dtype), self.staging,
                                             self.name))
        if dst.device.type == "cuda":
            torch.cuda.current_stream(dst.device).synchronize()  # before staging is reused
        self.store.free(Tier.HOST, TensorClass.STAGING, self.staging)


def start_load(store: Store, st: SegmentState):
    if st.tier == Tier.DISK:
        return DiskLoad(store, st)
    return WireLoad(store, st) if st.wire is not None else HostLoad(store, st)


def reload_resident(store: Store, st: SegmentState) -> None:
    """Bring a resident segment's device copy up to date after an update of its host or disk
    state (reallocated first where its compute copy changed format)."""
    nbytes = st.device_nbytes()
    if st.device_weights.numel() * st.device_weights.element_size() != nbytes:
        store.free(Tier.DEVICE, TensorClass.COMPUTE, st.device_weights)
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, nbytes,
                                        dtype=torch.uint8)
    start_load(store, st).finish(st.device_weights)


def read_copies(store: Store, st: SegmentState, copies: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named flat copies of one segment on the host (disk: read into fresh staging; the
    caller frees them with `free_copies`)."""
    if st.tier != Tier.DISK:
        return {c: getattr(st, c) for c in copies}
    bufs = {c: store.alloc(Tier.HOST, TensorClass.STAGING, st.numel) for c in copies}
    futures = [store.read_file(st.file(c), bufs[c]) for c in copies]
    for f in futures:
        f.result()
    return bufs


def write_back_copies(
    store: Store, st: SegmentState, bufs: dict[str, torch.Tensor],
    copies: tuple[str, ...] | None = None,
) -> None:
    """After `read_copies` and an update in place: on the disk tier, write `copies` (default:
    every buffer in `bufs`) back to their files, all at once, then free the staging buffers;
    elsewhere the buffers are the state itself and nothing is left to do."""
    if st.tier != Tier.DISK:
        return
    futures = [store.write_file(st.file(c), bufs[c], _FILE_CLASS[c]) for c in copies or bufs]
    for f in futures:
        f.result()
    free_copies(store, st, bufs)


def free_copies(store: Store, st: SegmentState, bufs: dict[str, torch.Tensor]) -> None:
    if st.tier == Tier.DISK:
        for b in bufs.values():
            store.free(Tier.HOST, TensorClass.STAGING, b)

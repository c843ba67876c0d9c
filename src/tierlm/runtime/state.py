"""Per-segment model state in flat buffers on its tier, and the ways to read and refresh it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from tierlm.memory.disk import ALIGN_BYTES
from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import STAGING_SETS, SegmentPlacement, chunk_ranges
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
    "grad": TensorClass.GRAD,
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


class LookupOnce(Mapping[str, torch.Tensor]):
    """A source of initial weights that keeps the tensor it returned last, so packing a
    segment chunk by chunk looks each name up once (a parameter the chunks cut is asked for
    again by the next chunk; a lazy source would read it again)."""

    def __init__(self, source: Mapping[str, torch.Tensor]) -> None:
        self.source = source
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self.source[name])
        return self._last[1]

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


def init_state(
    store: Store, st: SegmentState, fill: Callable[[torch.Tensor, int], object],
    optim_device: torch.device, chunk_numel: int,
) -> None:
    """Place the segment's initial weights and zeroed optimizer state. `fill(out, lo)` writes
    elements [lo, lo + out.numel()) of the packed fp32 weights into `out`: the master on its
    tier whole, or on the disk tier chunk by chunk into the staging its files are written
    from, so no second copy of the segment is made on the way."""
    n = st.numel
    st.steps = [new_step_counter(optim_device) for _ in st.layout.groups()]
    if st.tier == Tier.DISK:
        copies = (*STATE_COPIES, "grad")
        for c in copies:  # the gradient file too: the disk tier's size is known up front
            store.reserve_file(st.file(c), 4 * n, _FILE_CLASS[c])
        if st.placement.resident and st.compute_format is None:  # else: ComputeCopies.attach
            st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            fill(bufs["master"], lo)
            if st.device_weights is not None:
                st.device_weights.narrow(0, lo, bufs["master"].numel()).copy_(bufs["master"])
            for c in copies[1:]:
                bufs[c].zero_()

        stream_chunks(store, st, chunk_numel, read=(), write=copies, step=step)
        return
    st.master = store.alloc(st.tier, TensorClass.MASTER, n)
    fill(st.master, 0)
    st.exp_avg = store.zeros(st.tier, TensorClass.OPTIM, n)
    st.exp_avg_sq = store.zeros(st.tier, TensorClass.OPTIM, n)
    st.grad = store.zeros(st.tier, TensorClass.GRAD, n)
    if st.tier == Tier.DEVICE:
        st.device_weights = st.master  # fp32: the master is what the matmuls read
    elif st.placement.resident and st.compute_format is None:  # else: ComputeCopies.attach
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)
        st.device_weights.copy_(st.master)


class HostLoad:
    """Streamed weights whose source is the host master: one H2D copy."""

    def __init__(self, store: Store, st: SegmentState) -> None:
        self.store, self.st = store, st

    def finish(self, dst: torch.Tensor) -> None:
        self.store.wait(self.store.to_device(dst.view(torch.float32), self.st.master,
                                             self.st.seg.name))


class DiskLoad:
    """Streamed fp32 weights read from the master file into host staging chunk by chunk, each
    chunk one H2D copy; the next chunk is read while this one crosses, so staging holds two
    chunks, not the segment. The first reads start at construction so prefetching overlaps them
    with compute."""

    def __init__(self, store: Store, st: SegmentState, chunk_numel: int) -> None:
        self.store = store
        self.name = st.seg.name
        self.file = st.file("master")
        self.ranges = chunk_ranges(st.numel, chunk_numel)
        self.bufs = [store.alloc(Tier.HOST, TensorClass.STAGING, self.ranges[0][1])
                     for _ in self.ranges[:STAGING_SETS]]
        self.reads = [self._read(k) for k in range(len(self.bufs))]

    def _read(self, k: int):
        lo, n = self.ranges[k]
        return self.store.read_file(self.file, self.bufs[k % len(self.bufs)][:n], lo * 4)

    def finish(self, dst: torch.Tensor) -> None:
        dst = dst.view(torch.float32)
        for k, (lo, n) in enumerate(self.ranges):
            self.reads[k].result()
            event = self.store.to_device(
                dst.narrow(0, lo, n), self.bufs[k % len(self.bufs)][:n], self.name
            )
            self.store.wait(event)
            if event is not None:
                event.synchronize()  # the copy has read the buffer before it is reused or freed
            if k + len(self.bufs) < len(self.ranges):
                self.reads.append(self._read(k + len(self.bufs)))
        for buf in self.bufs:
            self.store.free(Tier.HOST, TensorClass.STAGING, buf)


class ComputeFileLoad:
    """Streamed weights of a bf16/fp8 run read from the segment's compute file (its compute
    copy, 1-2 bytes per parameter of a block) into host staging, then one H2D copy. The disk
    read starts at construction so prefetching overlaps it with compute."""

    def __init__(self, store: Store, st: SegmentState) -> None:
        self.store = store
        self.name = st.seg.name
        self.staging = store.alloc(Tier.HOST, TensorClass.STAGING, st.compute_format.nbytes,
                                   dtype=torch.uint8)
        self.future = store.read_file(st.file("compute"), self.staging)

    def finish(self, dst: torch.Tensor) -> None:
        self.future.result()
        self.store.wait(self.store.to_device(dst.view(self.staging.dtype), self.staging,
                                             self.name))
        if dst.device.type == "cuda":
            torch.cuda.current_stream(dst.device).synchronize()  # before staging is reused
        self.store.free(Tier.HOST, TensorClass.STAGING, self.staging)


def start_load(store: Store, st: SegmentState, chunk_numel: int):
    if st.tier == Tier.DISK:
        if st.compute_format is not None:
            return ComputeFileLoad(store, st)
        return DiskLoad(store, st, chunk_numel)
    return WireLoad(store, st) if st.wire is not None else HostLoad(store, st)


def reload_resident(store: Store, st: SegmentState, chunk_numel: int) -> None:
    """Bring a resident segment's device copy up to date after an update of its host or disk
    state (reallocated first where its compute copy changed format)."""
    nbytes = st.device_nbytes()
    if st.device_weights.numel() * st.device_weights.element_size() != nbytes:
        store.free(Tier.DEVICE, TensorClass.COMPUTE, st.device_weights)
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, nbytes,
                                        dtype=torch.uint8)
    start_load(store, st, chunk_numel).finish(st.device_weights)


class DiskTensor:
    """One parameter's slice of a disk-tier copy file, read only when opened: checkpoints of a
    segment whose state lives on disk then hold one parameter at a time in host RAM, not the
    segment's three copies (a 152k-token embedding is 233M parameters)."""

    def __init__(self, store: Store, file: str, slot) -> None:
        self.store, self.file = store, file
        self.offset, self._numel = slot.offset, slot.numel
        self.shape: tuple[int, ...] = tuple(slot.shape)
        self.dtype = torch.float32

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4

    @contextlib.contextmanager
    def open(self) -> Iterator[torch.Tensor]:
        """The slice's values, in staging freed on exit (reads start at an O_DIRECT offset)."""
        start = self.offset * 4 // ALIGN_BYTES * ALIGN_BYTES
        skip = self.offset - start // 4
        buf = self.store.alloc(Tier.HOST, TensorClass.STAGING, skip + self._numel)
        try:
            self.store.read_file(self.file, buf, start).result()
            yield buf[skip:].view(self.shape)
        finally:
            self.store.free(Tier.HOST, TensorClass.STAGING, buf)


def as_tensor(t: torch.Tensor | DiskTensor) -> torch.Tensor:
    """A tensor of a state shard as a tensor of its own (a DiskTensor read into fresh memory):
    for the few callers that keep it, e.g. a collective."""
    if isinstance(t, DiskTensor):
        with t.open() as values:
            return values.clone()
    return t


@contextlib.contextmanager
def opened(t: torch.Tensor | DiskTensor) -> Iterator[torch.Tensor]:
    """A tensor of a state shard, as values (a DiskTensor is read for the duration)."""
    if isinstance(t, DiskTensor):
        with t.open() as values:
            yield values
    else:
        yield t


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


ChunkStep = Callable[[int, dict[str, torch.Tensor]], None]
"""Work on one chunk of a segment's state: (first element, {copy: the chunk's host buffer})."""


def stream_chunks(
    store: Store, st: SegmentState, chunk_numel: int, *, read: tuple[str, ...],
    write: tuple[str, ...], step: ChunkStep,
) -> None:
    """Run `step` over a disk-tier segment's state chunk by chunk: the `read` copies of each
    chunk come from their files into host staging, `step` works on them in place (and may fill
    the `write`-only ones), the `write` copies go back to their files. Two sets of chunk
    buffers alternate, so the next chunk's reads run while `step` works on this one and this
    chunk's writes run behind the next `step`; host staging is two chunks per copy, not the
    segment."""
    ranges = chunk_ranges(st.numel, chunk_numel)
    copies = tuple(dict.fromkeys(read + write))
    sets = [{c: store.alloc(Tier.HOST, TensorClass.STAGING, ranges[0][1]) for c in copies}
            for _ in ranges[:STAGING_SETS]]
    writes: list[list] = [[] for _ in sets]

    def start_reads(k: int) -> list:
        lo, n = ranges[k]
        bufs = sets[k % len(sets)]
        for f in writes[k % len(sets)]:  # the chunk these buffers held is on disk first
            f.result()
        return [store.read_file(st.file(c), bufs[c][:n], lo * 4) for c in read]

    try:
        reads = start_reads(0)
        for k, (lo, n) in enumerate(ranges):
            for f in reads:
                f.result()
            reads = start_reads(k + 1) if k + 1 < len(ranges) else []
            bufs = {c: b[:n] for c, b in sets[k % len(sets)].items()}
            step(lo, bufs)
            writes[k % len(sets)] = [
                store.write_file(st.file(c), bufs[c], _FILE_CLASS[c], lo * 4) for c in write
            ]
        for fs in writes:
            for f in fs:
                f.result()
    finally:
        for bufs in sets:
            for b in bufs.values():
                store.free(Tier.HOST, TensorClass.STAGING, b)

"""Per-segment model state in flat buffers on its tier, and the ways to read and refresh it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tierlm.memory.device import AFTER_COMPUTE
from tierlm.memory.disk import ALIGN_BYTES
from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import STAGING_SETS, SegmentPlacement, chunk_ranges, staging_numel
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.models.adapters import Segment
from tierlm.node.client import NodeClient
from tierlm.optim.flat import StateSlot, new_step_counter
from tierlm.precision.streaming import ComputeFormat, WireLoad

# The two copies every segment has besides its optimizer's slots: one fp32 element per parameter
# element, so they take the same range arithmetic (tierlm.optim.flat) as any elementwise slot.
MASTER = StateSlot("master", cls=TensorClass.MASTER)
GRAD = StateSlot("grad", cls=TensorClass.GRAD)
_RESERVED = ("master", "grad", "compute")  # copy names a slot may not take (its file names)


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
    # the optimizer's state slots (tierlm.optim.flat): one buffer (or disk file) each
    slots: tuple[StateSlot, ...] = ()
    # Flat buffers on `placement.state_tier` (None / empty while they live in files on disk):
    # the fp32 master and gradient, and each slot's buffer by slot name.
    master: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[torch.Tensor] = field(default_factory=list)  # one counter per optimizer group
    device_weights: torch.Tensor | None = None  # resident compute copy (or the master itself)
    device_stale: bool = False  # the resident copy predates the last update
    # while stale: an event after every compute that has read the resident copy (the step's
    # finish marks it), which its refresh in place waits for (`refresh_resident`); None:
    # unknown (the copy went stale outside a step), the refresh waits for the compute queued
    read_done: Any = None
    grad_written: bool = False  # disk: this step's gradient file holds a partial sum
    # The compute copy in the precision each weight computes in (tierlm.precision.streaming):
    # its format (None: the segment streams and computes from its fp32 master) and, for host
    # state, the host copy (disk state keeps it in its `compute` file).
    compute_format: ComputeFormat | None = None
    wire: torch.Tensor | None = None
    # Frozen weights (a LoRA run's base): the master is all the state there is, read-only, no
    # gradient (no buffer, no file) and no optimizer slots; streamed like any other.
    frozen: bool = False
    # Which of two sets of files holds the disk-tier state (master, slots, compute copy): a
    # speculative update (EngineOptions.speculative_updates) writes the other set, and its
    # commit flips this. The gradient file has one set: no update writes it.
    generation: int = 0

    def __post_init__(self) -> None:
        if self.frozen and self.slots:
            raise ValueError("frozen weights take no optimizer state")
        names = [s.name for s in self.slots]
        bad = [n for n in names if n in _RESERVED or names.count(n) > 1]
        if bad:
            raise ValueError(f"optimizer slot names must be unique and not one of {_RESERVED}: "
                             f"{bad}")

    @property
    def state_copies(self) -> tuple[str, ...]:
        """The copies an update rewrites: the master and every slot (the gradient is spent)."""
        return ("master", *(s.name for s in self.slots))

    def slot(self, copy: str) -> StateSlot:
        """The shape rule of copy `copy` (the master and gradient are fp32 elementwise)."""
        if copy == "master":
            return MASTER
        if copy == "grad":
            return GRAD
        return next(s for s in self.slots if s.name == copy)

    def buffer(self, copy: str) -> torch.Tensor:
        """The flat buffer of a copy of host- or device-tier state."""
        if copy in ("master", "grad"):
            return getattr(self, copy)
        return self.state[copy]

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def tier(self) -> Tier:
        return self.placement.state_tier

    def file(self, copy: str) -> str:
        """The disk-tier file of copy `copy` in the current generation: every reader's."""
        return generation_file(self.seg.name, copy, self.generation)

    def spare(self) -> SegmentState:
        """This state naming the other generation's files (shared buffers, counters and
        format): what a speculative update writes through, its reads from this one's."""
        return replace(self, generation=self.generation ^ 1)

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


def generation_file(segment: str, copy: str, generation: int) -> str:
    """A disk-tier copy's file in `generation` (0 or 1); the gradient's has one name."""
    if copy == "grad" or generation == 0:
        return f"{segment}/{copy}.bin"
    return f"{segment}/{copy}.spare.bin"


def reserve_spare(store: Store, st: SegmentState) -> None:
    """Count a speculated disk-tier segment's spare generation on the disk tier up front (its
    master, slots and compute copy: `persistent_bytes(..., spare=True)`), as `init_state`
    counts the first."""
    spare = st.spare()
    for c in st.state_copies:
        slot = st.slot(c)
        store.reserve_file(spare.file(c), slot.nbytes(st.layout), slot.cls)
    if st.compute_format is not None:
        store.reserve_file(spare.file("compute"), st.compute_format.nbytes, TensorClass.COMPUTE)


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
    optim_device: torch.device, ranges: list[tuple[int, int]],
) -> None:
    """Place the segment's initial weights and zeroed optimizer state. `fill(out, lo)` writes
    elements [lo, lo + out.numel()) of the packed fp32 weights into `out`: the master on its
    tier whole, or on the disk tier chunk by chunk (`ranges`, cut where the optimizer's slots
    can be cut) into the staging its files are written from, so no second copy of the segment
    is made on the way."""
    n = st.numel
    st.steps = [] if st.frozen else [new_step_counter(optim_device)
                                      for _ in st.layout.groups()]
    grad = () if st.frozen or st.placement.host_grad else ("grad",)
    if st.tier == Tier.DISK:
        if st.placement.host_grad and not st.frozen:  # the gradient waits in RAM, no file
            st.grad = store.zeros(Tier.HOST, TensorClass.GRAD, n)
        copies = (*st.state_copies, *grad)
        for c in copies:  # the gradient file too: the disk tier's size is known up front
            slot = st.slot(c)
            store.reserve_file(st.file(c), slot.nbytes(st.layout), slot.cls)
        if st.placement.resident and st.compute_format is None:  # else: ComputeCopies.attach
            st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            fill(bufs["master"], lo)
            if st.device_weights is not None:
                st.device_weights.narrow(0, lo, bufs["master"].numel()).copy_(bufs["master"])
            for c in copies[1:]:
                bufs[c].zero_()

        stream_chunks(store, st, ranges, read=(), write=copies, step=step)
        return
    # a host master crosses PCIe itself where no compute copy streams for it: pinned
    copy = None if st.compute_format is None else st.compute_format.nbytes
    st.master = store.alloc(st.tier, TensorClass.MASTER, n,
                            pinned=pinned_class(st.placement, copy) == TensorClass.MASTER)
    fill(st.master, 0)
    for slot in st.slots:
        st.state[slot.name] = store.alloc(st.tier, slot.cls, slot.numel(st.layout), slot.dtype)
        st.state[slot.name].zero_()
    if not st.frozen:
        st.grad = store.zeros(st.tier, TensorClass.GRAD, n)
    if st.tier == Tier.DEVICE:
        st.device_weights = st.master  # fp32: the master is what the matmuls read
    elif st.placement.resident and st.compute_format is None:  # else: ComputeCopies.attach
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)
        st.device_weights.copy_(st.master)


def init_remote_state(store: Store, st: SegmentState, fill: Callable[[torch.Tensor, int], object],
                      node: NodeClient) -> None:
    """Place a remote segment (`placement.remote`): its fp32 master goes to the memory node
    (`put_state`; the node holds zeroed slots and gradient since `configure`), host RAM keeps
    the landed gradient and the compute copy the stream uploads from, which comes back from the
    node (`fetch_compute_copy`). Without a compute format the copy is the fp32 weights, kept in
    `st.master` (TensorClass.COMPUTE: the mirror of the node's master as of its last update),
    which is what was sent, so nothing is fetched. `st.steps` mirror the node's counters (each
    update advances both; the node checks the count it is asked for). The initial weights cross
    once here, as setup: none of it is a step's network bytes."""
    n = st.numel
    st.steps = [new_step_counter() for _ in st.layout.groups()]
    fp32 = st.compute_format is None
    cls = TensorClass.COMPUTE if fp32 else TensorClass.STAGING
    master = store.alloc(Tier.HOST, cls, n, pinned=fp32)  # pinned: it streams (pinned_class)
    fill(master, 0)
    node.put_state(st.seg.name, {"master": master})
    if fp32:
        st.master = master
    else:
        store.free(Tier.HOST, TensorClass.STAGING, master)
        st.wire = store.alloc(Tier.HOST, TensorClass.COMPUTE, st.compute_format.nbytes,
                              dtype=torch.uint8, pinned=True)
        fetch_compute_copy(node, st)
    st.grad = store.zeros(Tier.HOST, TensorClass.GRAD, n)
    if st.placement.resident and fp32:  # as `init_state` fills a resident host segment's
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, n)
        st.device_weights.copy_(st.master)
    elif st.placement.resident:  # as `ComputeCopies.attach` does
        st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE,
                                        st.compute_format.nbytes, dtype=torch.uint8)
        copied = store.to_device(st.device_weights, st.wire, st.seg.name)
        store.wait(copied)
        store.wait_host(copied, st.seg.name)


def remote_copy(st: SegmentState) -> torch.Tensor:
    """A remote segment's host compute copy: its compute copy's bytes, or its fp32 weights."""
    return st.master if st.compute_format is None else st.wire


def fetch_compute_copy(node: NodeClient, st: SegmentState, kinds: list[str] | None = None
                       ) -> None:
    """Bring a remote segment's compute copy from the node into its host copy (`kinds`: a new
    per-parameter format the node re-encodes to; None: the one it holds)."""
    node.get_compute_copy(st.seg.name, kinds=kinds, out=remote_copy(st))


def remote_copy_nbytes(st: SegmentState) -> int:
    """Bytes a remote segment's compute copy takes on the network (c: its copy, or 4n)."""
    return remote_step_bytes(st.placement, st.numel,
                             None if st.compute_format is None else st.compute_format.nbytes)[1]


def remote_step_bytes(placement: SegmentPlacement, numel: int, copy_bytes: int | None
                      ) -> tuple[int, int]:
    """The payload bytes one optimizer step moves between the trainer and the memory node for
    a segment (docs/architecture.md, the remote step): (to the node: its fp32 gradient, 4n;
    back: its compute copy, `copy_bytes`, or 4n of fp32 weights where it has none); (0, 0)
    for a segment that is not remote. A skipped step moves none. The engine's ledger counts
    exactly these on Link.NET_SEND and Link.NET_RECV; the planner's network lane must too."""
    if not placement.remote:
        return 0, 0
    return 4 * numel, 4 * numel if copy_bytes is None else copy_bytes


def step_net_bytes(placements: list[SegmentPlacement], numels: list[int],
                   copy_bytes: list[int | None]) -> tuple[int, int]:
    """(to the node, from the node) payload bytes of one optimizer step that is not skipped,
    over every segment (`remote_step_bytes` summed): the engine's ledger counts exactly these
    per step on Link.NET_SEND and Link.NET_RECV, and the planner's network lane must book
    them (tests/node/test_remote_tier.py compares the ledger with this)."""
    per = [remote_step_bytes(p, n, c)
           for p, n, c in zip(placements, numels, copy_bytes, strict=True)]
    return sum(up for up, _ in per), sum(down for _, down in per)


def persistent_bytes(
    placement: SegmentPlacement, numel: int, slot_bytes: int, copy_bytes: int | None, *,
    frozen: bool = False, base_copy: bool = False, spare: bool = False,
) -> list[tuple[Tier, TensorClass, int]]:
    """(tier, class, bytes) a segment's state holds for the whole run, as `init_state` and the
    compute copies' `attach` allocate it: the fp32 master on its tier, the optimizer's slots
    (`slot_bytes`) and the gradient (on its gradient tier) unless the weights are frozen; for
    state off the device its compute copy (`copy_bytes`; None: the master serves) in host RAM or
    in its file, and a resident segment's device copy. A frozen base held in its own copy
    (`base_copy`: NF4 or bf16, tierlm.runtime.frozen) has that copy as all its state.
    `spare`: speculative updates (EngineOptions.speculative_updates): disk-tier state that
    trains holds a second generation of its master, slots and compute copy files
    (`reserve_spare`)."""
    tier = placement.state_tier
    if placement.remote:
        return _remote_bytes(placement, numel, slot_bytes, copy_bytes, frozen=frozen)
    if base_copy:
        out = [(tier, TensorClass.COMPUTE, copy_bytes)]
    else:
        out = [(tier, TensorClass.MASTER, 4 * numel)]
        if not frozen:
            out += [(tier, TensorClass.OPTIM, slot_bytes),
                    (placement.gradient_tier, TensorClass.GRAD, 4 * numel)]
        if tier != Tier.DEVICE and copy_bytes is not None:
            out.append((tier, TensorClass.COMPUTE, copy_bytes))
    if tier != Tier.DEVICE and placement.resident:
        out.append((Tier.DEVICE, TensorClass.COMPUTE,
                    4 * numel if copy_bytes is None else copy_bytes))
    if spare and tier == Tier.DISK and not frozen and not base_copy:
        out += [(tier, cls, nbytes) for t, cls, nbytes in out
                if t == Tier.DISK and cls != TensorClass.GRAD]
    return out


def _remote_bytes(placement: SegmentPlacement, numel: int, slot_bytes: int,
                  copy_bytes: int | None, *, frozen: bool) -> list[tuple[Tier, TensorClass, int]]:
    """`persistent_bytes` of a segment whose state lives on a memory node: the node holds the
    fp32 master, the optimizer's slots, the gradient it sums what is pushed into, and the
    compute copy it encodes (none where the master serves); host RAM holds the landed gradient
    and the compute copy the stream uploads from (fp32 weights where there is no copy)."""
    if frozen:
        raise ValueError("frozen weights on a memory node are not supported yet")
    out = [(Tier.REMOTE, TensorClass.MASTER, 4 * numel),
           (Tier.REMOTE, TensorClass.OPTIM, slot_bytes),
           (Tier.REMOTE, TensorClass.GRAD, 4 * numel)]
    if copy_bytes is not None:
        out.append((Tier.REMOTE, TensorClass.COMPUTE, copy_bytes))
    out += [(Tier.HOST, TensorClass.GRAD, 4 * numel),
            (Tier.HOST, TensorClass.COMPUTE, 4 * numel if copy_bytes is None else copy_bytes)]
    if placement.resident:
        out.append((Tier.DEVICE, TensorClass.COMPUTE,
                    4 * numel if copy_bytes is None else copy_bytes))
    return out


def pinned_class(placement: SegmentPlacement, copy_bytes: int | None) -> TensorClass | None:
    """The class of a segment's persistent host buffer that crosses PCIe, pinned for the run
    (tierlm.memory.arena): host-tier state streams (and a resident copy is refreshed) from its
    compute copy (`copy_bytes`; None: it has none) or else its fp32 master. None for device
    state, and for disk state, which crosses from the step's staging. Its optimizer state and
    gradient never cross and stay pageable. The engine allocates by it and the planner's replay
    counts by it."""
    if placement.state_tier != Tier.HOST:
        return None
    if placement.remote:  # its host copy is the compute copy, fp32 or not
        return TensorClass.COMPUTE
    return TensorClass.MASTER if copy_bytes is None else TensorClass.COMPUTE


@dataclass(frozen=True)
class LoadBytes:
    """What one load of a streamed segment's device copy (`start_load`) stages and moves."""

    staging_bytes: int  # host staging (pinned) held until the copy is on the device
    disk_read_bytes: int
    h2d_bytes: int
    staging_buffers: int = 1  # the staging comes in this many equal buffers


def load_bytes(tier: Tier, numel: int, copy_bytes: int | None, chunk_numel: int) -> LoadBytes:
    """The bytes of `start_load`'s loader for a segment of `numel` parameters on `tier` whose
    compute copy is `copy_bytes` (None: it streams its fp32 master): a disk-tier compute file
    is staged whole (`ComputeFileLoad`), a disk-tier master in chunks (`DiskLoad`), host state
    crosses straight from RAM."""
    if tier == Tier.DISK and copy_bytes is not None:
        return LoadBytes(copy_bytes, copy_bytes, copy_bytes)
    if tier == Tier.DISK:
        return LoadBytes(4 * staging_numel(numel, chunk_numel), 4 * numel, 4 * numel,
                         staging_buffers=min(STAGING_SETS, len(chunk_ranges(numel, chunk_numel))))
    return LoadBytes(0, 0, 4 * numel if copy_bytes is None else copy_bytes)


class HostLoad:
    """Streamed weights whose source is the host master: one H2D copy, issued at `start` (the
    prefetch), waited for at `finish`."""

    def __init__(self, store: Store, st: SegmentState) -> None:
        self.store, self.st = store, st
        self.started, self.copied = False, None

    def start(self, dst: torch.Tensor, after) -> None:
        self.started = True
        self.copied = self.store.to_device(dst.view(torch.float32), self.st.master,
                                           self.st.seg.name, after=after)

    def finish(self, dst: torch.Tensor) -> None:
        if not self.started:
            self.start(dst, AFTER_COMPUTE)
        self.store.wait(self.copied, self.st.seg.name)


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
        self.bufs = [store.alloc(Tier.HOST, TensorClass.STAGING, self.ranges[0][1], pinned=True)
                     for _ in self.ranges[:STAGING_SETS]]
        self.reads = [self._read(k) for k in range(len(self.bufs))]
        self.after = AFTER_COMPUTE  # what the uploads wait for (`start` may narrow it)

    def _read(self, k: int):
        lo, n = self.ranges[k]
        return self.store.read_file(self.file, self.bufs[k % len(self.bufs)][:n], lo * 4)

    def start(self, dst: torch.Tensor, after) -> None:
        self.after = after  # each chunk's upload waits for it (its reads started already)

    def finish(self, dst: torch.Tensor) -> None:
        dst = dst.view(torch.float32)
        for k, (lo, n) in enumerate(self.ranges):
            self.reads[k].result()
            event = self.store.to_device(
                dst.narrow(0, lo, n), self.bufs[k % len(self.bufs)][:n], self.name,
                after=self.after,
            )
            self.store.wait(event)
            # the copy has read the buffer before it is reused or freed
            self.store.wait_host(event, self.name)
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
                                   dtype=torch.uint8, pinned=True)
        self.future = store.read_file(st.file("compute"), self.staging)
        self.copied, self.uploaded = None, False
        self.after = AFTER_COMPUTE  # what the upload waits for (`start` may narrow it)

    def start(self, dst: torch.Tensor, after) -> None:
        self.after = after
        if self.future.done():  # read already: its upload goes now
            self._upload(dst)

    def _upload(self, dst: torch.Tensor) -> None:
        self.uploaded = True
        self.future.result()
        self.copied = self.store.to_device(dst.view(self.staging.dtype), self.staging,
                                           self.name, after=self.after)

    def finish(self, dst: torch.Tensor) -> None:
        if not self.uploaded:
            self._upload(dst)
        copied = self.copied
        self.store.wait(copied)
        self.store.wait_host(copied, self.name)  # the copy has read staging before it is freed
        self.store.free(Tier.HOST, TensorClass.STAGING, self.staging)


def start_load(store: Store, st: SegmentState, chunk_numel: int):
    if st.tier == Tier.DISK:
        if st.compute_format is not None:
            return ComputeFileLoad(store, st)
        return DiskLoad(store, st, chunk_numel)
    return WireLoad(store, st) if st.wire is not None else HostLoad(store, st)


def refresh_due(st: Any, update: Any) -> bool:
    """Whether a resident copy is refreshed ahead of its first use (the engine's
    `_refresh_ahead` and the planner's replay of it): stale, and its update (a Future, or None
    where none is pending) done, so the training thread does not wait for it here."""
    return (st.placement.resident and st.device_stale
            and (update is None or update.done()))


def refresh_resident(store: Store, st: SegmentState, chunk_numel: int):
    """Start bringing a resident segment's device copy up to date after an update of its host
    or disk state, ahead of its first use: its disk read (if any) now, its upload into the copy
    in place once the last compute that read it is done (`st.read_done`), not behind the
    compute queued since. Returns the load, which `reload_resident` finishes at the first use
    (compute waits for it there); None where the copy changes format (`reload_resident`
    reallocates it at the use)."""
    if st.device_weights.numel() * st.device_weights.element_size() != st.device_nbytes():
        return None
    load = start_load(store, st, chunk_numel)
    load.start(st.device_weights, _last_read(st))
    return load


def _last_read(st: SegmentState) -> Any:
    """What an upload into `st`'s resident copy in place waits for."""
    return AFTER_COMPUTE if st.read_done is None else [st.read_done]


def reload_resident(store: Store, st: SegmentState, chunk_numel: int, load=None) -> None:
    """Bring a resident segment's device copy up to date after an update of its host or disk
    state: finish `load` (`refresh_resident`'s, started ahead), or load it now (reallocated
    first where its compute copy changed format)."""
    if load is None:
        nbytes = st.device_nbytes()
        after = _last_read(st)  # in place: once the last compute that read it is done
        if st.device_weights.numel() * st.device_weights.element_size() != nbytes:
            store.free(Tier.DEVICE, TensorClass.COMPUTE, st.device_weights)
            st.device_weights = store.alloc(Tier.DEVICE, TensorClass.COMPUTE, nbytes,
                                            dtype=torch.uint8)
            after = AFTER_COMPUTE  # fresh memory: compute queued so far may still use it
        load = start_load(store, st, chunk_numel)
        load.start(st.device_weights, after)
    load.finish(st.device_weights)
    st.read_done = None  # compute reads the fresh copy from here on: its next reads are unknown


class DiskTensor:
    """One parameter's part of a disk-tier copy file, read only when opened: checkpoints of a
    segment whose state lives on disk then hold one parameter at a time in host RAM, not the
    segment's copies (a 152k-token embedding is 233M parameters). `offset` and `numel` count
    elements of `dtype` in the file; `shape` is the part's checkpoint shape."""

    def __init__(self, store: Store, file: str, offset: int, numel: int,
                 shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        self.store, self.file = store, file
        self.offset, self._numel = offset, numel
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype = dtype
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    @classmethod
    def of(cls, store: Store, st: SegmentState, copy: str) -> dict[str, DiskTensor]:
        """Parameter name -> its part of copy `copy`'s file (parameters owning none left out)."""
        slot, layout = st.slot(copy), st.layout
        return {p.name: cls(store, st.file(copy), off, slot.param_numel(p), slot.param_shape(p),
                            slot.dtype)
                for p, off in zip(layout.slots, slot.offsets(layout), strict=True)
                if slot.param_numel(p)}

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._itemsize

    @contextlib.contextmanager
    def open(self) -> Iterator[torch.Tensor]:
        """The part's values, in staging freed on exit (reads start at an O_DIRECT offset)."""
        start = self.offset * self._itemsize // ALIGN_BYTES * ALIGN_BYTES
        skip = self.offset - start // self._itemsize  # elements: a block holds whole ones
        buf = self.store.alloc(Tier.HOST, TensorClass.STAGING, skip + self._numel, self.dtype)
        try:
            self.store.read_file(self.file, buf, start).result()
            yield buf[skip:].view(self.shape)
        finally:
            self.store.free(Tier.HOST, TensorClass.STAGING, buf)


class RemoteTensor(DiskTensor):
    """One parameter's part of a remote segment's copy on the memory node, fetched only when
    opened (`get_state` of its element range): a checkpoint of a remote segment holds one
    parameter at a time in host RAM, as one of a disk segment does. `offset` and `numel` count
    elements of the node's flat copy."""

    def __init__(self, store: Store, node: Any, segment: str, copy: str, offset: int,
                 numel: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(store, copy, offset, numel, shape, dtype)
        self.node, self.segment, self.copy = node, segment, copy

    @classmethod
    def of(cls, store: Store, st: SegmentState, copy: str, node: Any = None
           ) -> dict[str, RemoteTensor]:
        """Parameter name -> its part of copy `copy` on `node` (parameters owning none left
        out)."""
        slot, layout = st.slot(copy), st.layout
        return {p.name: cls(store, node, st.seg.name, copy, off, slot.param_numel(p),
                            slot.param_shape(p), slot.dtype)
                for p, off in zip(layout.slots, slot.offsets(layout), strict=True)
                if slot.param_numel(p)}

    @contextlib.contextmanager
    def open(self) -> Iterator[torch.Tensor]:
        """The part's values, fetched from the node into staging freed on exit."""
        buf = self.store.alloc(Tier.HOST, TensorClass.STAGING, self._numel, self.dtype)
        try:
            self.node.get_state(self.segment, [self.copy], out={self.copy: buf},
                                lo=self.offset, count=self._numel)
            yield buf.view(self.shape)
        finally:
            self.store.free(Tier.HOST, TensorClass.STAGING, buf)


def as_tensor(t: torch.Tensor | DiskTensor) -> torch.Tensor:
    """A tensor of a state shard as a tensor of its own (a DiskTensor or RemoteTensor read into
    fresh memory): for the few callers that keep it, e.g. a collective."""
    if isinstance(t, DiskTensor):
        with t.open() as values:
            return values.clone()
    return t


@contextlib.contextmanager
def opened(t: torch.Tensor | DiskTensor) -> Iterator[torch.Tensor]:
    """A tensor of a state shard, as values (a DiskTensor or RemoteTensor is read for the
    duration)."""
    if isinstance(t, DiskTensor):
        with t.open() as values:
            yield values
    else:
        yield t


class CopiesRead:
    """Whole flat copies of a disk-tier segment being read into fresh host staging: the reads
    start at construction (the update's read-ahead issues them during the backward);
    `buffers()` waits for them. The caller frees the staging (`free_copies`, or
    `write_back_copies` after an update in place)."""

    def __init__(self, store: Store, st: SegmentState, copies: tuple[str, ...]) -> None:
        self.st = st
        self.bufs = {c: store.alloc(Tier.HOST, TensorClass.STAGING, st.slot(c).numel(st.layout),
                                    st.slot(c).dtype) for c in copies}
        # a slot no parameter of the segment owns any of (a vector statistic of matrices) has
        # no bytes, and no file to read
        self._futures = [store.read_file(st.file(c), b) for c, b in self.bufs.items()
                         if b.numel()]

    def buffers(self) -> dict[str, torch.Tensor]:
        for f in self._futures:
            f.result()
        return self.bufs


def read_copies(store: Store, st: SegmentState, copies: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named flat copies of one segment on the host (disk: read into fresh staging; the
    caller frees them with `free_copies`)."""
    if st.tier != Tier.DISK:
        return {c: st.buffer(c) for c in copies}
    return CopiesRead(store, st, copies).buffers()


def write_back_copies(
    store: Store, st: SegmentState, bufs: dict[str, torch.Tensor],
    copies: tuple[str, ...] | None = None,
) -> None:
    """After `read_copies` and an update in place: on the disk tier, write `copies` (default:
    every buffer in `bufs`) back to their files, all at once, then free the staging buffers;
    elsewhere the buffers are the state itself and nothing is left to do."""
    if st.tier != Tier.DISK:
        return
    futures = [store.write_file(st.file(c), bufs[c], st.slot(c).cls) for c in copies or bufs
               if bufs[c].numel()]
    for f in futures:
        f.result()
    free_copies(store, st, bufs)


def free_copies(store: Store, st: SegmentState, bufs: dict[str, torch.Tensor]) -> None:
    if st.tier == Tier.DISK:
        for b in bufs.values():
            store.free(Tier.HOST, TensorClass.STAGING, b)


ChunkStep = Callable[[int, dict[str, torch.Tensor]], None]
"""Work on one chunk of a segment's state: (first parameter element, {copy: the chunk's part of
that copy, in the copy's dtype, on the host})."""


@dataclass(frozen=True)
class _Span:
    """One chunk's part of one copy file, in bytes: [start, end) its own, [env_start, env_end)
    what crosses staging (O_DIRECT moves whole blocks: a part that starts or ends inside a
    block carries the block's other bytes with it, which belong to the neighbouring chunks)."""

    start: int
    end: int
    env_start: int
    env_end: int


def _spans(slot: StateSlot, layout: FlatLayout, lo: int, hi: int, block: int) -> _Span:
    size = slot.dtype.itemsize
    a, b = slot.range(layout, lo, hi)
    total = slot.numel(layout) * size
    start, end = a * size, b * size
    env_end = end if end == total else min(-(-end // block) * block, total)
    return _Span(start, end, start // block * block, env_end)


def stream_chunks(
    store: Store, st: SegmentState, ranges: list[tuple[int, int]], *, read: tuple[str, ...],
    write: tuple[str, ...], step: ChunkStep, pinned: bool = False,
    written: SegmentState | None = None,
) -> None:
    """Run `step` over a disk-tier segment's state chunk by chunk: `ranges` are (first, length)
    in parameter elements (`chunk_ranges`, or the optimizer's `chunk_ranges` where slots are
    involved); each copy's part of a chunk is the slot's range of it, in the slot's dtype. The
    `read` copies of each chunk come from their files into host staging, `step` works on them in
    place (and may fill the `write`-only ones), the `write` copies go back to their files. Two
    sets of chunk buffers alternate, so the next chunk's reads run while `step` works on this one
    and this chunk's writes run behind the next `step`; host staging is two chunks per copy, not
    the segment.

    A part whose bytes do not start or end on an O_DIRECT block (an 8-bit slot, per-block scales,
    a cut at a parameter's start) shares that block with its neighbours: its head is patched
    with the previous chunk's final bytes of the block before it is written, and a chunk's writes
    go out only after the previous chunk's have landed, so the last write of a shared block holds
    every chunk's update.

    `pinned`: `step` copies between the device and the chunk buffers (a gradient's file
    passes), so they come from the pinned arena; an update, a load or a checkpoint's chunks
    stay on the host and are pageable.

    `written`: the state whose files the `write` copies go to (a speculative update's spare
    generation, `SegmentState.spare`); default `st`'s own."""
    copies = tuple(dict.fromkeys(read + write))
    out = written or st
    block = ALIGN_BYTES if store.disk.direct else 1
    spans = [{c: _spans(st.slot(c), st.layout, lo, lo + n, block) for c in copies}
             for lo, n in ranges]
    dtypes = {c: st.slot(c).dtype for c in copies}
    # envelopes start on a block and end on one or at the file's end: whole elements each
    size = {c: dtypes[c].itemsize for c in copies}
    longest = {c: max(sp[c].env_end - sp[c].env_start for sp in spans) // size[c]
               for c in copies}
    sets = [{c: store.alloc(Tier.HOST, TensorClass.STAGING, max(longest[c], 1), dtypes[c],
                            pinned=pinned)
             for c in copies} for _ in ranges[:STAGING_SETS]]
    writes: list[list] = [[] for _ in sets]
    carry: dict[str, tuple[int, torch.Tensor]] = {}  # copy -> (block start, its bytes so far)

    def start_reads(k: int) -> list:
        bufs = sets[k % len(sets)]
        for f in writes[k % len(sets)]:  # the chunk these buffers held is on disk first
            f.result()
        out = []
        for c in read:
            sp = spans[k][c]
            if sp.end > sp.start:
                n = (sp.env_end - sp.env_start) // size[c]
                out.append(store.read_file(st.file(c), bufs[c][:n], sp.env_start))
        return out

    try:
        reads = start_reads(0)
        for k, (lo, _) in enumerate(ranges):
            for f in reads:
                f.result()
            reads = start_reads(k + 1) if k + 1 < len(ranges) else []
            raw = sets[k % len(sets)]
            views = {}
            for c in copies:
                sp = spans[k][c]
                if sp.start > sp.env_start and c in carry and carry[c][0] == sp.env_start:
                    head = carry[c][1]
                    raw[c][: head.numel()].copy_(head)
                a, b = ((x - sp.env_start) // size[c] for x in (sp.start, sp.end))
                views[c] = raw[c][a:b]
            step(lo, views)
            for f in writes[(k - 1) % len(sets)] if k else ():
                f.result()  # a block this chunk shares with the previous one: theirs first
            writes[k % len(sets)] = []
            for c in write:
                sp = spans[k][c]
                if sp.end == sp.start:
                    continue
                tail = sp.end // block * block
                if tail < sp.end and sp.end < sp.env_end:  # the next chunk starts in this block
                    a, b = ((x - sp.env_start) // size[c] for x in (tail, sp.end))
                    carry[c] = (tail, raw[c][a:b].clone())
                n = (sp.env_end - sp.env_start) // size[c]
                writes[k % len(sets)].append(store.write_file(
                    out.file(c), raw[c][:n], st.slot(c).cls, sp.env_start))
        for fs in writes:
            for f in fs:
                f.result()
    finally:
        for bufs in sets:
            for b in bufs.values():
                store.free(Tier.HOST, TensorClass.STAGING, b)

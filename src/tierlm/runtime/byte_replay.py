"""The byte replay: the runtime's own step walk (tierlm.runtime.walk), schedule and cache policy run
over byte counts (`_simulate`), so the planner's memory prediction follows the runtime's
allocation pattern rather than a formula that could drift from it. Counting tensors (`_Bytes`),
a counting store (`_CountingStore`) and step (`_CountingStep`) stand in for the engine's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tierlm.activations.dynamic import SegmentCosts, activation_peak_bytes, head_workspace_bytes
from tierlm.memory.arena import ArenaReplay
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    STAGING_SETS,
    KeepGraphs,
    SegmentPlacement,
    chunk_ranges,
    keeps_graph,
)
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.runtime import schedule
from tierlm.runtime.cache import StreamCache, window_bytes
from tierlm.runtime.landing import LandingRing
from tierlm.runtime.readahead import readahead_starts
from tierlm.runtime.schedule import (
    grad_landing,
    held_before,
    keeps_landed_grad,
    landing_ring_numel,
    step_schedule,
    streamed_reads,
    transient_grad,
)
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.runtime.state import load_bytes, persistent_bytes, pinned_class
from tierlm.runtime.walk import StepRules, walk_step

if TYPE_CHECKING:
    from tierlm.runtime.readahead import ReadAhead

_DTYPE_OF_SIZE = {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}


class _Bytes:
    """Stands in for a tensor in the replay: only its size matters (and whether it is pinned).
    It takes the views, slices and in-place arithmetic the runtime's loaders and landing apply
    to their buffers (tierlm.plan.replay runs them on it), which change nothing but sizes."""

    def __init__(self, numel: int, itemsize: int = 4, pinned: bool = False, *,
                 dtype: torch.dtype | None = None) -> None:
        self._numel = numel
        self.dtype = dtype or _DTYPE_OF_SIZE[itemsize]
        self._itemsize = self.dtype.itemsize
        self.nbytes = numel * self._itemsize
        self.pinned = pinned
        self.offset = 0  # in the pinned arena's region, when pinned

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._itemsize

    def view(self, dtype: torch.dtype) -> _Bytes:
        return _Bytes(self.nbytes // dtype.itemsize, dtype=dtype)

    def narrow(self, dim: int, start: int, length: int) -> _Bytes:
        return _Bytes(length, dtype=self.dtype)

    def __getitem__(self, key: slice) -> _Bytes:
        return _Bytes(len(range(self._numel)[key]), dtype=self.dtype)

    def split(self, size: int) -> list[_Bytes]:
        return [self.narrow(0, lo, min(size, self._numel - lo))
                for lo in range(0, self._numel, size)]

    def clone(self) -> _Bytes:
        return _Bytes(self._numel, dtype=self.dtype)

    def add_(self, other: object) -> _Bytes:
        return self

    copy_ = mul_ = add_

    def zero_(self) -> _Bytes:
        return self


class _CountingStore:
    """The store on byte counts. Pinned buffers are also cut from an arena of offsets in the
    engine's order, whose size is what the engine's pinned arena needs (`arena.pinned_bytes`)."""

    def __init__(self, ledger: Ledger, arena: ArenaReplay | None = None) -> None:
        self.ledger = ledger
        self.arena = ArenaReplay() if arena is None else arena

    def alloc(self, tier: Tier, cls: TensorClass, numel: int, dtype=None, *,
              pinned: bool = False) -> _Bytes:
        t = _Bytes(numel, pinned=pinned, dtype=dtype or torch.float32)
        self.ledger.allocate(tier, cls, t.nbytes, pinned=pinned)
        if pinned:
            t.offset = self.arena.take(cls, t.nbytes)
        return t

    def free(self, tier: Tier, cls: TensorClass, t: _Bytes) -> None:
        self.ledger.release(tier, cls, t.nbytes, pinned=t.pinned)
        if t.pinned:
            self.arena.give(cls, t.nbytes, t.offset)

    def alloc_pinned(self, cls: TensorClass, nbytes: int, buffers: int) -> list[_Bytes]:
        """`nbytes` of pinned host buffers in `buffers` equal parts (the engine's chunk sets:
        each its own footprint in the arena)."""
        return [self.alloc(Tier.HOST, cls, nbytes // buffers, torch.uint8, pinned=True)
                for _ in range(buffers)]


def _compute_copies(shape: ModelShape, precision: str, placements) -> list[int | None]:
    """Per segment, the bytes of the compute copy the runtime keeps for it (state off the
    device, bf16/fp8 runs), None where its fp32 master serves (tierlm.precision.streaming)."""
    return [None if p.state_tier == Tier.DEVICE else shape.wire_bytes(s, precision)
            for s, p in enumerate(placements)]


def _disk_update_bytes(
    shape: ModelShape, copies: list[int | None], placements,
    read_ahead: frozenset[int] = frozenset(), *, kept: bool = False,
) -> tuple[int, int]:
    """Disk bytes (read, written) by one step's updates of disk-tier segments: master, grad
    and slots read (less a gradient held on the host or `kept` there by a speculation's
    landing, less what `read_ahead` segments read during the backward); master and slots
    written, and the compute copy re-encoded."""
    moved = [shape.update_disk_bytes(s, c, host_grad=p.host_grad or kept,
                                     read_ahead=s in read_ahead)
             for s, (c, p) in enumerate(zip(copies, placements, strict=True))
             if p.state_tier == Tier.DISK]
    return sum(r for r, _ in moved), sum(w for _, w in moved)


def remote_update_bytes(shape: ModelShape, copies: list[int | None], placements
                        ) -> tuple[int, int]:
    """Network payload bytes (to the memory node, back from it) of one step's updates of
    remote segments: each pushes its fp32 gradient and takes back its compute copy (its fp32
    weights where it has none), as the engine's remote update moves them."""
    remote = [s for s, p in enumerate(placements) if p.remote]
    return (sum(GRAD_B * shape.numels[s] for s in remote),
            sum(MASTER_B * shape.numels[s] if copies[s] is None else copies[s] for s in remote))


def readahead_schedule(
    shape: ModelShape, train: TrainShape, placements: list[SegmentPlacement], order: str,
    boundary_host: bool, readahead: ReadAhead | None, actions: list | None = None, *,
    speculative: bool = False,
) -> dict[int, list[int]]:
    """Action index -> disk-tier segments whose update state is read after it: the engine's
    rule (tierlm.runtime.readahead) on this plan's schedule and sizes (`speculative`: the
    engine's speculative disk-tier updates, which consume it in the backward's order)."""
    if readahead is None or shape.frozen:
        return {}
    sizes = [(s, shape.update_state_bytes(s)) for s, p in enumerate(placements)
             if p.state_tier == Tier.DISK]
    hidden = train.batch_size * train.seq_len * shape.hidden_size * 4
    return readahead_starts(actions if actions is not None else _actions(shape, train, order),
                            sizes, readahead.extra_bytes,
                            parked_input_bytes=hidden if boundary_host else 0,
                            speculative=speculative)


def _actions(shape: ModelShape, train: TrainShape, order: str) -> list:
    """The engine's schedule of one step (tierlm.runtime.schedule.step_schedule, which
    Engine.schedule calls) for this shape: a frozen embedding has no backward."""
    return step_schedule(len(shape.names), train.micro_batches, order,
                         first_trained=not shape.frozen)


def _stream_plan(shape: ModelShape, placements: list[SegmentPlacement], actions: list
                 ) -> list[list[int]]:
    """Streamed segments each action reads (Engine.stream_plan, by the same rule), in order."""
    resident = [p.resident for p in placements]
    tied_owners = [0] if shape.tied_numel else []  # the embedding owns every tie
    return [streamed_reads(a, resident, tied_owners) for a in actions]


class _CountingStep:
    """`Engine.step` on byte counts: the walk's backend in the planner's replay
    (tierlm.runtime.walk). Weights load through the runtime's own stream cache; compute makes
    boundary activations and gradients of one micro-batch's hidden states (fp32); holds, parks,
    gradient buffers, landings and reads ahead allocate, free and move their bytes in the
    ledger. `on_action(k, phase, action)` marks where the step is (see `_simulate`)."""

    def __init__(self, shape: ModelShape, placements: list[SegmentPlacement], store,
                 cache, actions: list, hidden: int, chunk_numel: int,
                 on_action: Callable[[int, str, Any], None], ring,
                 load: Callable[[int], Any] | None = None,
                 offloaded: Sequence[Sequence[int]] = (), speculative: bool = False,
                 held_gradients: int = 1) -> None:
        self.shape, self.placements, self.store, self.cache = shape, placements, store, cache
        self.ring = ring  # the step's landing ring (tierlm.runtime.landing.LandingRing)
        self.ledger: Ledger = store.ledger
        self.actions, self.chunk_numel, self.on_action = actions, chunk_numel, on_action
        self.streamed = [not p.resident for p in placements]
        self.act = _Bytes(hidden)  # a boundary input or its gradient
        self.grad_written = [False] * len(placements)
        self.ahead_held: list[_Bytes] = []  # read ahead, freed by the update
        self.landing: _Bytes | None = None  # the gradient the landing in flight reads
        # resident segments off the device whose copy the last update made stale: each reloads
        # at its first use (Engine._weights), a disk-tier one through the load's staging
        self.stale = {s for s, p in enumerate(placements)
                      if p.resident and p.state_tier != Tier.DEVICE and not shape.frozen}
        self.load = load  # the replay's loader of a segment's weights (start_load's bytes)
        # stale resident segments whose reload started ahead of their first use
        # (Engine._refresh_ahead, its update taken as done), until that use
        self.refreshing: dict[int, Any] = {}
        self.tied_owners = [0] if shape.tied_numel else []  # the embedding owns every tie
        # per segment, the host buffers the offload policy cuts from the pinned arena for one
        # micro-batch's forward and gives back after its backward (tierlm.activations.offload)
        self.offloaded = offloaded
        self.offload_held: dict[tuple[int, int], list[_Bytes]] = {}  # (micro-batch, segment)
        # speculative disk-tier updates (EngineOptions.speculative_updates): the gradients
        # their final landings keep in host RAM, the latest `held_gradients`; each is freed
        # when a later landing waits to keep its own (the engine's speculation has freed it
        # by then: schedule.held_before), the last ones after the sweep
        self.speculative, self.held_gradients = speculative, held_gradients
        self.kept: list[_Bytes] = []

    def begin(self, k: int, a: Any) -> None:
        self.on_action(k, "run", a)

    def weights(self, k: int, s: int) -> None:
        if self.streamed[s]:
            self.cache.acquire(k, s)
        elif s in self.refreshing:
            self.refreshing.pop(s).finish(None)
        elif s in self.stale and self.load is not None:  # moves counted with the persistent
            self.stale.discard(s)
            self.load(s, count=False).finish(None)

    def running(self, k: int, a: Any) -> contextlib.AbstractContextManager:
        return _NOTHING

    def prefetch(self, k: int) -> None:
        self.on_action(k - 1, "prefetch", self.actions[k - 1])  # action k - 1 starts them
        self.cache.prefetch(k)
        if k < len(self.actions):
            self.refresh_ahead(k)

    def refresh_ahead(self, k: int) -> None:
        """Engine._refresh_ahead: the stale resident segments action `k` reads start reloading
        (their staging taken) while action k - 1 runs."""
        for s in schedule.reads(self.actions[k], self.tied_owners):
            if s in self.stale and self.load is not None:
                self.stale.discard(s)
                self.refreshing[s] = self.load(s, count=False)

    def read_ahead(self, s: int) -> None:  # master and slots, whole, into staging
        nbytes = self.shape.update_state_bytes(s)
        self.ahead_held.append(self.store.alloc(Tier.HOST, TensorClass.STAGING, nbytes,
                                                torch.uint8))
        self.ledger.record_move(Link.DISK_READ, nbytes)

    def forward(self, a: Any, w: None, xs: list) -> Iterator[_Bytes]:
        sizes = self.offloaded[a.seg] if a.seg < len(self.offloaded) else ()
        for i in a.mbs:  # each output before the next micro-batch runs, as the engine's
            if sizes:
                self.offload_held[(i, a.seg)] = [
                    self.store.alloc(Tier.HOST, TensorClass.ACTIVATION, n, torch.uint8,
                                     pinned=True) for n in sizes]
            yield self.act

    def head(self, k: int, a: Any, i: int, w: None, x: _Bytes, grad: _Bytes,
             tied: _Bytes | None) -> _Bytes:
        return self.act

    def backward(self, a: Any, i: int, w: None, x: _Bytes | None, gout: _Bytes,
                 grad: _Bytes) -> _Bytes:
        for t in self.offload_held.pop((i, a.seg), ()):  # after the backward that read them
            self.store.free(Tier.HOST, TensorClass.ACTIVATION, t)
        return self.act

    def hold(self, t: _Bytes, boundary: int | None) -> None:
        self.ledger.allocate(Tier.DEVICE, TensorClass.ACTIVATION, t.nbytes)

    def drop(self, t: _Bytes, boundary: int | None) -> None:
        self.ledger.release(Tier.DEVICE, TensorClass.ACTIVATION, t.nbytes)

    def park(self, s: int, x: _Bytes) -> _Bytes:
        copy = self.store.alloc(Tier.HOST, TensorClass.ACTIVATION, x.numel(), pinned=True)
        self.ledger.record_move(Link.D2H, x.nbytes)
        return copy

    def wait_parked(self, copy: _Bytes) -> None:
        pass

    def unpark(self, s: int, copy: _Bytes) -> tuple[_Bytes, None]:
        self.ledger.record_move(Link.H2D, copy.nbytes)
        return self.act, None

    def arrived(self, s: int, event: None) -> None:
        pass

    def release_parked(self, copy: _Bytes) -> None:
        self.store.free(Tier.HOST, TensorClass.ACTIVATION, copy)

    def grad_buffer(self, s: int) -> _Bytes:
        if not transient_grad(self.placements[s].state_tier, self.shape.frozen):
            return _IN_PLACE  # the persistent gradient on the device (or none: frozen)
        return self.store.alloc(Tier.DEVICE, TensorClass.GRAD, self.shape.numels[s])

    def tied_grad(self) -> _Bytes:
        return self.store.alloc(Tier.DEVICE, TensorClass.GRAD, self.shape.numels[0])

    def add_grad(self, grad: _Bytes, part: _Bytes) -> None:
        self.store.free(Tier.DEVICE, TensorClass.GRAD, part)

    def land(self, s: int, grad: _Bytes, final: bool) -> None:
        p = self.placements[s]
        if not transient_grad(p.state_tier, self.shape.frozen):  # accumulated in place
            return
        numel = self.shape.numels[s]
        path = grad_landing(p.state_tier, p.gradient_tier, written=self.grad_written[s],
                            final=final)
        # the step's landing ring, taken by the first landing that adds into host RAM and held
        # to the sweep's end; then the landing's own host staging at its peak: each file pass's
        # chunk sets (tierlm.runtime.landing, tierlm.runtime.state)
        if path.ring_numel(numel, self.chunk_numel):
            self.ring.hold()
        if keeps_landed_grad(path, final=final,
                             speculated=self.speculative and p.state_tier == Tier.DISK):
            # on the landing worker, before its passes' chunk sets (Engine._file_passes)
            freed = held_before(self.kept, self.held_gradients)
            if freed is not None:
                self.kept.remove(freed)
                self.store.free(Tier.HOST, TensorClass.STAGING, freed)
            self.kept.append(self.store.alloc(Tier.HOST, TensorClass.STAGING, numel))
        staged = path.host_staging_numel(numel, self.chunk_numel)
        if staged:  # the file pass's chunk sets, pinned: the gradient crosses into them
            sets = min(STAGING_SETS, len(chunk_ranges(numel, self.chunk_numel)))
            for t in self.store.alloc_pinned(TensorClass.STAGING, GRAD_B * staged, sets):
                self.store.free(Tier.HOST, TensorClass.STAGING, t)
        for link, nbytes in path.moves(GRAD_B * numel):
            self.ledger.record_move(link, nbytes)
        self.grad_written[s] = path.written
        # a landing (into host RAM, or its passes into the gradient file) runs on the engine's
        # landing worker: its device gradient is freed when the engine next waits for it (the
        # next landing, or the sweep's end)
        self.settle_landing()
        self.landing = grad

    def settle_landing(self) -> None:
        if self.landing is not None:
            self.store.free(Tier.DEVICE, TensorClass.GRAD, self.landing)
            self.landing = None


_NOTHING = contextlib.nullcontext()


_IN_PLACE = _Bytes(0)  # a gradient buffer the replay does not count: the persistent one


def _simulate(
    shape: ModelShape,
    train: TrainShape,
    placements: list[SegmentPlacement],
    order: str,
    keep_resident: KeepGraphs,
    boundary_host: bool = False,
    *,
    ledger: Ledger | None = None,
    on_action: Callable[[int, str, Any], None] = lambda k, phase, action: None,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
    readahead: ReadAhead | None = None,
    parked: frozenset[int] | None = None,
    arena: ArenaReplay | None = None,
    offloaded: Sequence[Sequence[int]] = (),
    speculative: bool = False,
    held_gradients: int = 1,
) -> tuple[Ledger, int, int]:
    """Replay one steady-state step of `Engine.step` on byte counts. Returns the ledger, the
    activation workspace outside it, and the host staging held by a concurrent update. Its
    pinned buffers are cut from `arena` in the engine's order, whose `pinned_bytes()` is then
    the pinned arena the engine needs for that step.
    `on_action(k, phase, action)` marks where the replay is (phase "run": action k's waits,
    compute and gradient landing; "prefetch": the loads it starts for action k+1; "update":
    after the sweep), so a ledger that logs moves can place them (tierlm.plan.timeline).
    Disk-tier state crosses host staging in chunks of `chunk_numel` elements per copy;
    `readahead`: the update's read-ahead (tierlm.runtime.readahead), its reads counted at the
    backward actions the engine issues them after; `parked`: the segments whose boundary input
    waits on the host where the engine's activation policies say so (None: those `keep_resident`
    and `boundary_host` give); `offloaded`: per segment, the host buffers (bytes, in order) the
    offload policy takes from the pinned arena for each micro-batch's forward (() where the
    segment does not offload; tierlm.runtime.pinned.offload_sizes measures them);
    `speculative`: the engine's speculative disk-tier updates, whose final landings into a
    gradient file keep the gradient in host staging for them (held in the sweep's ledger as
    the engine holds them at most, `held_gradients` at once; the updates read no gradient
    file).

    The sweep is the engine's own walk (tierlm.runtime.walk) over a counting backend, and the
    rules are the engine's own functions (tierlm.runtime.schedule: the schedule, what an action
    reads, where a gradient goes, which boundary inputs park; tierlm.runtime.state: the
    persistent state and what a load stages and moves); this replay sets up the state before
    the sweep and counts the update after it."""
    ledger = Ledger() if ledger is None else ledger
    store = _CountingStore(ledger, arena)
    last = len(shape.names) - 1
    numels = shape.numels
    hidden = train.batch_size * train.seq_len * shape.hidden_size  # elements per boundary
    frozen = shape.frozen

    # the compute copy each segment is kept in off the device (None: its fp32 master), and
    # what one load of it stages and moves
    wire = _compute_copies(shape, train.precision, placements)
    loads = [load_bytes(p.state_tier, numels[s], wire[s], chunk_numel)
             for s, p in enumerate(placements)]

    if frozen:  # the adapters, their gradient and optimizer state, on the device throughout
        ledger.allocate(Tier.DEVICE, TensorClass.MASTER, MASTER_B * shape.trained_numel)
        ledger.allocate(Tier.DEVICE, TensorClass.GRAD, GRAD_B * shape.trained_numel)
        ledger.allocate(Tier.DEVICE, TensorClass.OPTIM, shape.trained_optim_bytes)
    for s, p in enumerate(placements):  # persistent state
        base = shape.base_copy(s)
        copy = wire[s] if base is None else base
        pinned = pinned_class(p, copy)  # what the segment's H2D copies read
        for tier, cls, nbytes in persistent_bytes(
                p, numels[s], 0 if frozen else shape.optim_state_bytes[s],
                copy, frozen=frozen, base_copy=base is not None):
            if tier == Tier.HOST and cls == pinned:  # cut from the arena's persistent region
                store.alloc(tier, cls, nbytes, torch.uint8, pinned=True)
            else:
                ledger.allocate(tier, cls, nbytes)

    class Load:  # tierlm.runtime.state.start_load's loader, on byte counts
        def __init__(self, s: int, count: bool = True) -> None:
            self.load = loads[s]
            self.count = count  # the moves (a resident reload's are counted with the state)
            # the disk read's staging, pinned: the H2D copy reads it
            self.staging = store.alloc_pinned(TensorClass.STAGING, self.load.staging_bytes,
                                              self.load.staging_buffers)
            if self.load.disk_read_bytes and count:
                ledger.record_move(Link.DISK_READ, self.load.disk_read_bytes)

        def start(self, dst, after) -> None:
            pass

        def finish(self, dst) -> None:
            if self.count:
                ledger.record_move(Link.H2D, self.load.h2d_bytes)
            for t in self.staging:
                store.free(Tier.HOST, TensorClass.STAGING, t)

    streamed = {i: loads[i].h2d_bytes for i, p in enumerate(placements) if not p.resident}
    cache = StreamCache(store, streamed.__getitem__, window_bytes(streamed.values()), Load)  # type: ignore[arg-type]
    actions = _actions(shape, train, order)
    ahead = readahead_schedule(shape, train, placements, order, boundary_host, readahead, actions,
                               speculative=speculative)
    keep = keeps_graph(placements, keep_resident)
    cache.begin(_stream_plan(shape, placements, actions))
    # resident segments with host/disk state are refreshed after each update: one load per step
    for s, p in enumerate(placements):
        if p.resident and p.state_tier != Tier.DEVICE and not frozen:
            ledger.record_move(Link.H2D, loads[s].h2d_bytes)
            if loads[s].disk_read_bytes:
                ledger.record_move(Link.DISK_READ, loads[s].disk_read_bytes)

    landings = [(p.state_tier, p.gradient_tier, numels[s])
                if transient_grad(p.state_tier, frozen) else None
                for s, p in enumerate(placements)]
    ring_numel = landing_ring_numel(actions, train.micro_batches, landings, chunk_numel)
    ring = LandingRing(store, ring_numel)  # type: ignore[arg-type]
    step = _CountingStep(shape, placements, store, cache, actions, hidden, chunk_numel,
                         on_action, ring, Load, offloaded, speculative and not frozen,
                         held_gradients)
    tied_owners = [0] if shape.tied_numel else []  # the embedding owns every tie
    rules = StepRules(
        micro_batches=train.micro_batches,
        # the boundary inputs that wait on the host: the engine's rule on the policies `keep`
        # gives (resident graphs kept, the rest recomputed)
        # the engine's rule, read from its module at each call (a test changes it there)
        parked=schedule.parked_inputs(["keep" if k else "full" for k in keep[:last]],
                                      boundary_host)
        if parked is None else parked,
        tied_owners=tied_owners,
        # the head's contribution to tied weights is held in a buffer the size of the owner's
        # gradient, which the owner's backward then accumulates its own into (frozen: none)
        tied_trained=bool(tied_owners) and not frozen,
        state_tiers=[p.state_tier for p in placements],
        first_trained=not frozen,
    )
    with ring:  # held from the first landing to the end of the sweep, as the engine does
        walk_step(step, actions, rules, ahead)
        step.settle_landing()
    for t in step.kept:  # freed by their speculations
        store.free(Tier.HOST, TensorClass.STAGING, t)

    on_action(len(actions), "update", None)
    # the optimizer update: disk segments read master, grad and slots, write master and slots
    # back (and their compute copy); staged chunk by chunk, or whole where a compute copy is
    # encoded or the optimizer takes whole segments
    read_ahead = frozenset(s for segs in ahead.values() for s in segs)
    update_read, update_write = _disk_update_bytes(shape, wire, placements, read_ahead,
                                                   kept=step.speculative)
    ledger.record_move(Link.DISK_READ, update_read)
    ledger.record_move(Link.DISK_WRITE, update_write)
    # remote segments: the gradient to the memory node, the compute copy back
    net_send, net_recv = remote_update_bytes(shape, wire, placements)
    if net_send:
        ledger.record_move(Link.NET_SEND, net_send)
        ledger.record_move(Link.NET_RECV, net_recv)
    for t in step.ahead_held:  # written back and freed by the update (`_update_overlap_bytes`)
        store.free(Tier.HOST, TensorClass.STAGING, t)
    update_staging = max([shape.update_staging(s, wire[s], chunk_numel,
                                               host_grad=p.host_grad, read_ahead=s in read_ahead)
                          for s, p in enumerate(placements) if p.state_tier == Tier.DISK],
                         default=0)

    # workspace outside the ledger, by the dynamic policy's byte model
    # (tierlm.activations.dynamic): graphs kept by resident segments for the micro-batches in
    # flight, then the larger of the head (its input, its gradient and one chunk of logits) and
    # one recomputed block's saved tensors during the backward
    workspace = activation_workspace_bytes(shape, train, keep[:last], order)
    # a QLoRA matmul decodes its NF4 weight into a buffer of its own, one weight at a time
    workspace += max(shape.base_decoded_bytes or [0])
    return ledger, workspace, update_staging


def activation_workspace_bytes(shape: ModelShape, train: TrainShape, keep: list[bool],
                               order: str) -> int:
    """Device bytes of activations outside the ledger at their peak over one step: segments
    that `keep` their graph hold one block's saved tensors per micro-batch in flight, the others
    recompute theirs in the backward (`full`); the head's chunked loss runs in between. One
    block's saved tensors are linear in the tokens (SDPA's fused kernel), measured under the
    run's precision."""
    tokens = train.batch_size * train.seq_len
    block = SegmentCosts(int(shape.saved_bytes_per_token(train.precision) * tokens), 0, 0)
    costs = [SegmentCosts(0, 0, 0)] + [block] * (len(keep) - 1)  # embed saves token ids only
    policies = ["keep" if k else "full" for k in keep]
    head = head_workspace_bytes(shape.head_chunk_tokens, shape.vocab_size, tokens,
                                shape.hidden_size)
    in_flight = train.micro_batches if order == "layer-outer" else 1
    return activation_peak_bytes(policies, costs, in_flight=in_flight, head_bytes=head)

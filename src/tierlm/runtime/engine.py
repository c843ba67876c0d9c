"""The tiered step (ARCHITECTURE.md section 3).

The engine executes one StepPlan (tierlm.runtime.plan), which says where each segment's state
lives and which activation policy it runs; it chooses nothing of its own. One optimizer step
over M micro-batches runs a precomputed list of actions:

    forward(segment, micro-batches)  ->  head(micro-batches)  ->  backward(segment, micro-batches)

`microbatch-outer` repeats the whole list per micro-batch; `layer-outer` runs each segment for all
micro-batches while its weights are on the device. Because the list is known before the step
starts, the stream cache evicts by next use and prefetches the next action's weights. The order
in which an action waits for, holds, parks, drops and lands what it touches is
tierlm.runtime.walk's, which the planner's replay walks too, over byte counts.

After the backward sweep the global gradient norm is known: the step is skipped on a non-finite
norm, otherwise gradients are clipped and each segment is updated on the tier that holds its
state. Host and disk updates run on a background worker in forward order, overlapping the next
step's forward: segment i's forward waits only for segment i's update. A disk-tier segment may
hold its gradient in host RAM (its placement's `grad_tier`), and the last group's backward may
read its master and slots ahead of the update (`EngineOptions.readahead`,
tierlm.runtime.readahead), and a disk-tier update ends once what the next forward reads is on
disk, its master and slots written back behind the step by one more thread
(`EngineOptions.writeback`, tierlm.runtime.writeback).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierlm.activations import (
    PolicyFactory,
    RunScope,
    SavedTensorScope,
    chunked_cross_entropy,
    storages_of,
)
from tierlm.activations.saved import FrozenWeights
from tierlm.config import OptimConfig
from tierlm.data.batch import IGNORE_INDEX, inputs_and_targets, position_ids, trained_targets
from tierlm.memory.arena import PinnedBytes
from tierlm.memory.device import Device
from tierlm.memory.placement import (
    PlacementReport,
    SegmentPlacement,
    chunk_ranges,
)
from tierlm.memory.store import Store, nbytes_of
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.models.adapters import HeadSegment, StepContext
from tierlm.optim.flat import advance
from tierlm.runtime.cache import StreamCache, window_bytes
from tierlm.runtime.clock import compute_clock
from tierlm.runtime.costs import SegmentCost
from tierlm.runtime.landing import LandingRing, add_to_host
from tierlm.runtime.pinned import step_pinned_bytes
from tierlm.runtime.plan import EngineOptions, StepParts, StepPlan, plan_step
from tierlm.runtime.readahead import readahead_starts
from tierlm.runtime.schedule import (
    Action,
    boundary_activation_bytes,
    grad_landing,
    landing_ring_numel,
    parked_inputs,
    step_schedule,
    streamed_reads,
    transient_grad,
)
from tierlm.runtime.state import (
    CopiesRead,
    DiskTensor,
    InitialWeights,
    LookupOnce,
    SegmentState,
    free_copies,
    init_state,
    module_weights,
    read_copies,
    reload_resident,
    start_load,
    stream_chunks,
    write_back_copies,
)
from tierlm.runtime.stepper import Stepper
from tierlm.runtime.walk import StepRules, walk_step
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, Writer, deferred_copies


def _empty_parameter(p: torch.nn.Parameter) -> None:
    """Drop `p`'s storage, keeping the Parameter object (ties, modules' references). A meta
    parameter (a skeleton's) moves to the CPU as it empties, so export can later fill it like
    any other (`.data` cannot change a tensor's device; swapping the tensors can)."""
    if p.is_meta:
        torch.utils.swap_tensors(
            p, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
        )
    else:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for a forward outside training (held-out loss, sampling), as the
    reference trainer's `model.eval()`: no dropout in the held-out loss, and nothing drawn from
    the training random stream (a resumed or reference run would draw other masks after)."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


@dataclass
class _MicroBatch:
    ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T)
    positions: torch.Tensor | None = None  # (B, T) for packed examples; None: 0..T-1
    ctx: StepContext | None = None
    saved: dict[int, object] = field(default_factory=dict)  # activation policy handles


class Engine(Stepper):
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        plan: StepPlan,
        *,
        device: torch.device | Device,
        store: Store | None = None,
        initial_weights: InitialWeights = module_weights,
    ) -> None:
        """Run `plan` (tierlm.runtime.plan: a placement per segment, an activation policy per
        segment, the run's options) on `model`; the engine chooses none of it (`build_engine`
        has `plan_step` choose from EngineOptions first).

        `initial_weights`: each segment's starting weights; the default reads the model's
        parameters, tierlm.models.load.CheckpointWeights reads a checkpoint into a model
        whose parameters are on the meta device. Either way the parameters are emptied once
        their segment is in place."""
        options = plan.options
        self.plan = plan
        self.opts = options
        self.chunk_numel = options.staging_chunk_numel
        self.tracer = options.tracer
        self.store = store or Store(device, offload_dir=options.offload_dir, tracer=self.tracer)
        # every stream, event, wait and host read of the step (tierlm.memory.device)
        self.dev = self.store.dev
        self.device = device = self.dev.torch_device
        self.ledger = self.store.ledger
        parts = StepParts(model, optim, options)
        self.adapter = parts.adapter
        self.compute_copies = parts.compute_copies
        frozen_copy = parts.frozen_copy
        place_state = self.compute_copies.init_state if frozen_copy else init_state
        self.optimizer = parts.optimizer
        options.grad_sync.check_optimizer(self.optimizer)
        self.has_dropout = any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
        ) or float(getattr(model.config, "attention_dropout", 0) or 0) > 0
        # held-out loss and sampling without dropout; a model without any keeps its modules'
        # mode (a compiled block would compile once more for eval mode, for nothing)
        self._outside_training: Callable[[], contextlib.AbstractContextManager] = (
            functools.partial(_eval_mode, model) if self.has_dropout else contextlib.nullcontext)

        segs = self.adapter.segments
        self.index = {s.name: i for i, s in enumerate(segs)}
        self.frozen_base = parts.frozen_base
        layouts, trained_layouts = parts.layouts, parts.trained_layouts
        self.tied_trained = parts.tied_trained
        self.host_boundaries = parts.host_boundaries
        self.hidden_bytes = parts.hidden_bytes  # one micro-batch's boundary input (fp32)
        self.activation_bytes = parts.activation_bytes
        # what the plan chose: this engine executes it
        self.report: PlacementReport = plan.report
        if len(plan.placements) != len(segs):
            raise ValueError(f"the plan places {len(plan.placements)} segments; the model has "
                             f"{len(segs)} ({', '.join(self.index)})")
        self.park_by_policy = plan.park_recomputed
        self.activation_reserve_bytes = plan.activation_reserve_bytes
        self.activation_costs = plan.activation_costs  # measured per-segment bytes (dynamic)
        self.activation_head_bytes = parts.head_bytes  # the head's predicted activation peak
        self.chunk_tokens = parts.chunk_tokens  # tokens per cross-entropy chunk at the head
        self._make_policy = PolicyFactory(self.dev, dropout=self.has_dropout)
        self.set_activation_policies(list(plan.activation_policies))
        # The host buffers PCIe copies read or write come from one pinned arena, sized before
        # anything is allocated by the rule the plan's pinned bytes come from
        # (tierlm.runtime.pinned) for the planned step; a step of another shape checks it again.
        self._pinned_rule = functools.partial(step_pinned_bytes, parts, self.report.placements,
                                              options)
        if plan.report.pinned is not None:  # plan_step's count, for these very policies
            self._pinned_need[(options.micro_batches, options.batch_size, options.seq_len)] = (
                plan.report.pinned)
        self.store.open_arena(self.pinned_bytes(options.micro_batches, options.batch_size,
                                                options.seq_len))
        self.states: list[SegmentState] = []
        # per segment: the state the optimizer updates (the segment's own, or its adapters on
        # the device; None: nothing of it is trained), and its frozen weights' current copy
        self.trained: list[SegmentState | None] = []
        self.frozen: list[FrozenWeights | None] = []
        for i, (seg, lay, plc) in enumerate(
            zip(segs, layouts, self.report.placements, strict=True)
        ):
            st = SegmentState(index=i, seg=seg, layout=lay, placement=plc,
                              slots=() if self.frozen_base else self.optimizer.slots,
                              frozen=self.frozen_base)
            optim_device = device if plc.state_tier == Tier.DEVICE else torch.device("cpu")
            self.compute_copies.choose_format(st)
            # packed straight into the segment's tier (or the disk tier's staging), tensor by
            # tensor from the source, before the next segment is read
            source = LookupOnce(initial_weights(seg))
            place_state(self.store, st, functools.partial(lay.pack, source), optim_device,
                        self._update_ranges(st))
            self.compute_copies.attach(self.store, st)
            trained: SegmentState | None = None if self.frozen_base else st
            if self.frozen_base and trained_layouts[i].numel:
                trained = SegmentState(
                    index=i, seg=seg, layout=trained_layouts[i],
                    placement=SegmentPlacement(True, Tier.DEVICE), slots=self.optimizer.slots)
                init_state(self.store, trained, functools.partial(trained_layouts[i].pack,
                                                                  source), device, [])
            del source  # it holds the tensor packed last: gone before the next segment is read
            self.trained.append(trained)
            self.frozen.append(FrozenWeights() if self.frozen_base else None)
            # Modules never own live storage: drop the parameters' memory, the runtime supplies
            # views of its flat buffers on every call.
            for _, p, _ in seg.params:
                _empty_parameter(p)
            self.states.append(st)

        self.cache = StreamCache(
            self.store,
            lambda s: self.states[s].device_nbytes(),  # asked when a slot is taken
            0,  # sized by _size_cache
            lambda s: start_load(self.store, self.states[s], self.chunk_numel),
            ready=lambda s: s not in self._updates or self._updates[s].done(),
            # a graph a segment keeps (keep, selective, offload) holds its weights until its
            # backward; the head's is spent within its action
            reusable=lambda s: s >= len(self.policies) or self.policies[s].recomputes,
        )
        self._size_cache()
        self.borrowed: dict[str, tuple[int, int, int]] = {}  # name -> (owner, offset, numel)
        head = self.states[-1]
        for name, owner in head.seg.borrowed.items():
            o = self.states[self.index[owner]]
            slot = next(s for s in o.layout.slots if s.name == name)
            self.borrowed[name] = (o.index, slot.offset, slot.numel)
        self._borrowed_leaf: dict[str, torch.Tensor] = {}
        self._worker = self.dev.worker("update")
        # gradient landings into host RAM, in the order the backward issues them
        self._lander = self.dev.worker("landing", overlaps_device=True)
        # the landing in flight: its future, its device gradient and the segment it completes
        self._landing: tuple[Future, torch.Tensor, SegmentState | None] | None = None
        self._writer = Writer(self.store, (options.writeback or DEFAULT_WRITEBACK).segments)
        self._updates: dict[int, Future] = {}
        # segment -> its master and slots being read ahead of its update (the read-ahead)
        self._readahead: dict[int, CopiesRead] = {}
        self.update_wait_s = 0.0  # time the step spent waiting for background updates
        self.transfer_wait_s = 0.0  # time the step spent waiting for weights to arrive
        # time in forward, backward and on-device updates (also the trace's compute lane)
        self.clock = compute_clock(self.dev)
        # each segment's FLOPs as the simulated device prices its regions (tierlm.runtime.costs)
        self.costs = self._segment_costs(model)
        self.skipped_steps = 0
        self.param_norms: dict[str, torch.Tensor] = {}
        self._syncing: list = []  # (segment, gradient, pending sync) until the norms are taken
        # The reference optimizer's order: decaying parameters, then the rest, in model order.
        slots = [slot for st in self.trainable for slot in st.layout.slots]
        model_order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.norm_order = [
            s.name for s in sorted(slots, key=lambda s: (not s.decay, model_order[s.name]))
        ]
        # what a segment without trained parameters differentiates, and its gradient
        self._no_params = torch.empty(0, device=device)

    def _segment_costs(self, model: torch.nn.Module) -> list[SegmentCost]:
        head = len(self.states) - 1
        tied = sum(n for _, _, n in self.borrowed.values())
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or
                               getattr(model.config, "n_embd", 0))
        return [SegmentCost(params=st.numel + (tied if st.index == head else 0),
                            block=0 < st.index < head, frozen=self.frozen_base)
                for st in self.states]

    @property
    def trainable(self) -> list[SegmentState]:
        """The states the optimizer updates, in segment order."""
        return [t for t in self.trained if t is not None]

    def _trained_flat(self, s: int, w: torch.Tensor) -> torch.Tensor:
        """The flat the activation policy differentiates for segment `s`, whose weights on the
        device are `w`: `w` itself when the segment's weights are trained; for a frozen base,
        `w` becomes the frozen copy this action reads and the adapters are differentiated."""
        frozen = self.frozen[s]
        if frozen is None:
            return w
        frozen.flat = w
        t = self.trained[s]
        return self._no_params if t is None else t.master

    def _param_views(self, s: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of segment `s` on the flat `_trained_flat` gave (or a leaf of it)."""
        frozen = self.frozen[s]
        if frozen is None:
            return self.states[s].views(flat)
        views = self.states[s].views(frozen.flat)
        if self.trained[s] is not None:
            views.update(self.trained[s].layout.views(flat))
        return views

    def _size_cache(self) -> None:
        """Room for the largest streamed device copies (`window_bytes`), in the format their next
        refresh gives them (a layer switched from fp8 to bf16 grows its segment's copy)."""
        self.cache.capacity_bytes = window_bytes(
            self.compute_copies.nbytes(st) for st in self.states if not st.placement.resident)

    # -- schedule ----

    # The schedule and its rules are tierlm.runtime.schedule's pure functions, which the
    # planner's replay calls too; these methods apply them to this engine's segments.
    boundary_activation_bytes = staticmethod(boundary_activation_bytes)

    def schedule(self, m: int) -> list[Action]:
        """The actions of an m-micro-batch step, in order."""
        return step_schedule(len(self.states), m, self.opts.microbatch_order,
                             first_trained=self.trained[0] is not None)

    def stream_plan(self, m: int) -> list[list[int]]:
        """Streamed segments each action of an m-micro-batch step reads, in order: the access
        sequence the stream cache is given (monitoring replays it to know the planned fetches)."""
        return [self._needs(a) for a in self.schedule(m)]

    def _needs(self, a: Action) -> list[int]:
        """Streamed segments whose device copy action `a` reads (the head also reads tied
        weights)."""
        return streamed_reads(a, [st.placement.resident for st in self.states],
                              [owner for owner, _, _ in self.borrowed.values()])

    def readahead_plan(self, actions: list[Action]) -> dict[int, list[int]]:
        """Action index -> disk-tier segments whose update state is read after that action
        (tierlm.runtime.readahead; empty when the read-ahead is off)."""
        ra = self.opts.readahead
        if ra is None:
            return {}
        sizes = [(st.index, sum(st.slot(c).nbytes(st.layout) for c in st.state_copies))
                 for st in self.trainable if st.tier == Tier.DISK]
        return readahead_starts(
            actions, sizes, ra.extra_bytes,
            parked_input_bytes=self.hidden_bytes if self.host_boundaries else 0)

    # -- weights ----

    def _wait_update(self, s: int) -> None:
        fut = self._updates.pop(s, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()  # re-raises a failed update here, in the training thread
            t1 = time.perf_counter()
            self.update_wait_s += t1 - t0
            self.tracer.record("wait", f"update {self.states[s].seg.name}", t0, t1,
                               cat="update wait")

    @property
    def engine(self) -> Engine:  # the placement the planner predicts is this one's
        return self

    def synchronize(self) -> None:
        """Wait for every pending optimizer update and write-back (before eval, checkpoints,
        export)."""
        for s in list(self._updates):
            self._wait_update(s)
        self._writer.drain()

    def _weights(self, k: int, s: int) -> torch.Tensor:
        self._wait_update(s)
        st = self.states[s]
        t0 = time.perf_counter()
        if not st.placement.resident:
            # a copy still in flight (prefetched) or not started: this call waits for it
            arrived = s in self.cache.pending or s not in self.cache.entries
            w = self.cache.acquire(k, s)
        else:
            arrived = st.device_stale
            if st.device_stale:
                reload_resident(self.store, st, self.chunk_numel)
                st.device_stale = False
            w = st.device_weights
        # Host-side wait: on CUDA an H2D copy the compute stream waits for is not included.
        t1 = time.perf_counter()
        self.transfer_wait_s += t1 - t0
        if arrived:
            self.tracer.record("wait", f"weights {st.seg.name}", t0, t1, cat="transfer wait")
        return st.flat(w)

    def _views(self, k: int, s: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of segment `s`; for the head also the borrowed (tied) weights, as
        leaves of their own whose gradients `_collect_tied` gathers for the owner."""
        views = self._param_views(s, flat)
        self._borrowed_leaf = {}
        if s == len(self.states) - 1:
            for name, (owner, off, n) in self.borrowed.items():
                tied = self._weights(k, owner).narrow(0, off, n).detach()
                if self.tied_trained:
                    self._borrowed_leaf[name] = tied.requires_grad_()
                views[name] = tied.view(self._slot_shape(owner, name))
        return views

    def _slot_shape(self, owner: int, name: str) -> tuple[int, ...]:
        return next(s.shape for s in self.states[owner].layout.slots if s.name == name)

    # -- activations ----

    def set_activation_policies(self, names: list[str]) -> None:
        """Policy per segment before the head (keep, selective, full, offload), from the next
        step on; any of them reproduces the others' math."""
        n = len(self.adapter.segments) - 1
        if len(names) != n:
            raise ValueError(f"expected {n} policies (every segment but the head), got {names}")
        if self.host_boundaries and not self.park_by_policy and any(
                name != "full" for name in names):
            raise ValueError(
                f"--boundary-activations host needs the full activation policy on every segment "
                f"(got {', '.join(sorted(set(names)))}): a kept graph pins the boundary input on "
                "the device; pass --grad-checkpointing full or dynamic, or --boundary-activations "
                "device"
            )
        # the boundary inputs parked on the host: those of segments that recompute from them
        self.parked_inputs = parked_inputs(names, self.host_boundaries)
        self.activation_policies = list(names)
        self.policies = [self._make_policy(name) for name in names]
        # what a step pins depends on the inputs parked: counted again under these policies
        self._pinned_need: dict[tuple[int, int, int], PinnedBytes] = {}

    def _run(self, st: SegmentState, mb: _MicroBatch):
        """Segment `st` on micro-batch `mb`: (flat weights, boundary input) -> output."""

        def run(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            with self.opts.autocast():
                return st.seg.forward(self._param_views(st.index, flat), x, mb.ctx)

        return run

    def _scope(self, st: SegmentState, mb: _MicroBatch, x: torch.Tensor) -> RunScope:
        return RunScope(st.seg.name, self.ledger, storages_of(x, mb.ctx), self.frozen[st.index])

    def _bring_back(self, upcoming: list[Action], mbs: list[_MicroBatch]) -> None:
        """The next backward's offloaded activations start back to the device now, so their
        copy overlaps the current action (a no-op for the other policies)."""
        for a in upcoming:
            if a.kind == "bwd":
                for i in a.mbs:
                    self.policies[a.seg].bring_back(mbs[i].saved[a.seg])


    # -- the step ----

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        """One optimizer step over `batches` (each (B, T+1) token ids) at learning rate `lr`.

        The actions run in the order of tierlm.runtime.walk, which the planner's replay walks
        too. Every action first waits for the weights it reads (the previous update, then the
        copy: `update_wait_s`, `transfer_wait_s`), then computes; `compute_s` is what the compute
        clock measured inside the actions (also the trace's compute lane)."""
        t0 = time.perf_counter()
        begun = self.dev.begin_step()
        trace = self.tracer
        names = [st.seg.name for st in self.states]
        with trace.span("step", "begin step", cat="step"):
            self.ledger.reset_step()
            self.update_wait_s = 0.0
            self.transfer_wait_s = 0.0
            self.clock.take()  # drop what evaluation or a checkpoint measured
            m = len(batches)
            mbs = []
            # the step's loss is its summed token loss over the step's trained tokens, known
            # before the forward: every micro-batch's (this rank's share of each row, under
            # context parallel), and every rank's where the sync averages gradients
            tokens = 0
            share = self.opts.sequence_share
            for b in batches:
                ids, targets = inputs_and_targets(b)
                ids, targets, positions = share.take(ids, targets, position_ids(b))
                # counted in the batch's own memory, before it moves: on the device, the count
                # would be a host read waiting for the device's queue, per micro-batch
                tokens += int((targets != IGNORE_INDEX).sum())
                ids, targets = self.dev.upload(ids), self.dev.upload(targets)
                positions = None if positions is None else self.dev.upload(positions)
                # the embed segment reads the positions (GPT-2's are learned); the full context
                # replaces this one once the embedding exists
                mbs.append(_MicroBatch(ids, targets, positions,
                                       ctx=self.adapter.embed_context(ids, positions)))
            # a step of a larger shape than planned (more micro-batches, longer rows) grows
            # the pinned arena's step region, between steps
            b, t = mbs[0].ids.shape
            self.store.arena.reserve_transient(self.pinned_bytes(m, b, t).transient_bytes)
            divisor = self.opts.grad_sync.loss_divisor(tokens)
            actions = self.schedule(m)
            readahead = self.readahead_plan(actions)
            if self.compute_copies.enabled:
                self._size_cache()
            self.cache.begin(self.stream_plan(m))
            self.param_norms = {}
            # the step's summed token loss, added up on the device (`_TensorStep.head`) and
            # read once, with the gradient norm (`_finish_step`)
            self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # every landing of the sweep adds into host RAM through this one ring (released on
        # leaving the block, an exception included; a skipped step has landed by then)
        with LandingRing(self.store, self.landing_ring_numel(actions, m)) as ring:
            run = _TensorStep(self, mbs, actions, names, ring, divisor)
            try:
                walk_step(run, actions, self.step_rules(m), readahead)
            finally:
                self._drain_landings()  # they add through the ring, released next
        sweep_s = time.perf_counter() - t0
        # link rates from the copies' own events, those finished by now (a GPU's async copies
        # return at once: the store counted their bytes, the device times them)
        for link, seconds in self.dev.take_link_s().items():
            self.ledger.add_move_seconds(link, seconds)
        with trace.span("step", "finish step", cat="step"):
            loss, grad_norm, skipped = self._finish_step(lr)
        return {
            "loss": loss,  # the step's summed token loss over `divisor`
            "loss_tokens": tokens,  # trained targets of this rank's step
            "loss_divisor": divisor,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "sweep_s": sweep_s,  # forward + backward, including waits for weights
            "compute_s": self.clock.take(),  # forward, backward, on-device updates; no waits
            "update_wait_s": self.update_wait_s,  # part of sweep_s spent on the last update
            "transfer_wait_s": self.transfer_wait_s,  # part of sweep_s spent waiting for weights
            "step_time_s": time.perf_counter() - t0,
            **self.dev.end_step(begun),  # a simulated device's step in virtual time
        }

    def pinned_bytes(self, m: int, batch_size: int, seq_len: int) -> PinnedBytes:
        """Pinned host bytes (arena footprints) a step of `m` micro-batches of `batch_size` x
        `seq_len` tokens holds: the persistent ones and the step's peak
        (tierlm.runtime.pinned, the planner's replay on this engine's parts)."""
        key = (m, batch_size, seq_len)
        if key not in self._pinned_need:
            self._pinned_need[key] = self._pinned_rule(
                micro_batches=m, batch_size=batch_size, seq_len=seq_len,
                parked=self.parked_inputs)
        return self._pinned_need[key]

    def landing_ring_numel(self, actions: list[Action], m: int) -> int:
        """Elements of the landing ring a step of `actions` over `m` micro-batches holds
        (tierlm.runtime.schedule.landing_ring_numel, the rule the planner's replay counts)."""
        landings = [None if st is None or not transient_grad(st.tier, st.frozen)
                    else (st.tier, st.placement.gradient_tier, st.numel) for st in self.trained]
        return landing_ring_numel(actions, m, landings, self.chunk_numel)

    def step_rules(self, m: int) -> StepRules:
        """This engine's answers to what an m-micro-batch step's walk asks
        (tierlm.runtime.walk)."""
        return StepRules(
            micro_batches=m, parked=self.parked_inputs,
            tied_owners=[owner for owner, _, _ in self.borrowed.values()],
            tied_trained=self.tied_trained, state_tiers=[st.tier for st in self.states],
            first_trained=self.trained[0] is not None,
        )

    # -- compute (tierlm.runtime.walk holds, parks and drops what these return) ----

    def _forward(self, a: Action, mbs: list[tuple[_MicroBatch, torch.Tensor | None]],
                 w: torch.Tensor) -> Iterator[torch.Tensor]:
        """Forward action `a` on each of its micro-batches with its input (None: the token
        ids) in turn: each output, yielded before the next micro-batch runs."""
        s = a.seg
        st = self.states[s]
        w = self._trained_flat(s, w)
        cost = self.costs[s]
        for mb, x in mbs:
            x = mb.ids if x is None else x
            with self.clock.measure(f"forward {st.seg.name}", cost.forward(*self._shape(mb)),
                                    block=cost.block):
                out, mb.saved[s] = self.policies[s].forward(self._run(st, mb), w, x,
                                                            self._scope(st, mb, x))
                if s == 0:
                    with torch.no_grad(), self.opts.autocast():
                        mb.ctx = self.adapter.context(mb.ids, out, mb.positions,
                                                      ring=self.opts.sequence_share.ring)
            yield out

    def _head(
        self, k: int, mb: _MicroBatch, divisor: float, w: torch.Tensor, x: torch.Tensor,
        grad: torch.Tensor, tied: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed token loss of one micro-batch over `divisor` (the step's, see
        tierlm.data.batch; a 0-dim fp64 tensor on the device, not read here) and its gradient
        at the head's input `x`, chunk by chunk over tokens,
        so the full (tokens x vocab) logits never exist at once. The head's gradient
        accumulates in `grad`, the borrowed weights' in `tied` (None without trained ties)."""
        s = len(self.states) - 1
        st = self.states[s]
        seg: HeadSegment = st.seg  # type: ignore[assignment]
        w = self._trained_flat(s, w)
        frozen = self.frozen[s]
        leaf = w.detach().requires_grad_()
        leaf.grad = grad
        views = self._views(k, s, leaf)
        if tied is not None:
            self._collect_tied(tied)
        x = x.detach().requires_grad_()
        # The ledger counts what autograd saves here: the norm's tensors and the normed input
        # for the whole action, each chunk's log-softmax during that chunk.
        shared = storages_of(x, mb.ctx, [views[n] for n in self.borrowed])
        norm = SavedTensorScope(leaf, shared, frozen)
        flops = self.costs[s].head(self._shape(mb)[0])
        with self.clock.measure(f"head {seg.name}", flops), torch.enable_grad(), \
                self.opts.autocast(), norm.hooks():
            hn = seg.forward(views, x, mb.ctx)
        hn_leaf = hn.detach().requires_grad_()
        held = norm.bytes + nbytes_of(hn_leaf)
        self.ledger.hold_activation(seg.name, "saved", held)
        shared |= storages_of(hn_leaf)
        with self.clock.measure():  # priced with the head's forward above
            loss = chunked_cross_entropy(
                lambda h: seg.project(views, h),
                hn_leaf.flatten(0, 1),  # (B*T, D)
                mb.targets.flatten(),
                chunk_tokens=self.chunk_tokens,
                divisor=divisor,
                autocast=self.opts.autocast,
                saved=lambda: SavedTensorScope(leaf, shared, frozen),
                ledger=self.ledger,
                segment=seg.name,
                loss_of=self.opts.chunk_loss,
            )
            hn.backward(hn_leaf.grad)
        self.ledger.release_activation(seg.name, "saved", held)
        return loss, x.grad

    def _backward(
        self, s: int, mb: _MicroBatch, w: torch.Tensor, x: torch.Tensor | None,
        gout: torch.Tensor, grad: torch.Tensor,
    ) -> torch.Tensor:
        """Segment `s`'s gradient at its input `x` (None: the token ids) given `gout` at its
        output; `w`: the weights on the device, which every policy's backward reads; `grad`:
        where the segment's gradient accumulates."""
        st = self.states[s]
        w = self._trained_flat(s, w)
        x = mb.ids if x is None else x
        flops = self.costs[s].backward(*self._shape(mb), recompute=self.policies[s].recomputes)
        with self.clock.measure(f"backward {st.seg.name}", flops, block=self.costs[s].block):
            return self.policies[s].backward(mb.saved.pop(s), self._run(st, mb), w, x, gout,
                                             grad, self._scope(st, mb, x))

    def _shape(self, mb: _MicroBatch) -> tuple[int, int, int]:
        """(tokens, sequence length, hidden size) of micro-batch `mb` for the FLOP rule."""
        return mb.ids.numel(), mb.ids.shape[-1], self.hidden_size

    # -- gradients ----

    def _collect_tied(self, buf: torch.Tensor) -> None:
        """The head's tied weights (`_borrowed_leaf`, just made by `_views`) take their slots of
        `buf`, a zeroed buffer the size of the owner's gradient, as their gradients, so autograd
        accumulates the head's contribution straight into what the owner's backward then
        accumulates its own into (tierlm.runtime.walk)."""
        for name, b in self._borrowed_leaf.items():
            _, off, n = self.borrowed[name]
            b.grad = buf.narrow(0, off, n)

    def _grad_target(self, s: int) -> torch.Tensor:
        """Where autograd accumulates segment `s`'s gradient: the persistent gradient buffer
        for device state, a transient device buffer otherwise (an empty one where nothing of
        the segment is trained)."""
        st = self.trained[s]
        if st is None:
            return self._no_params
        if not transient_grad(st.tier, st.frozen):
            return st.grad
        return self.store.zeros(Tier.DEVICE, TensorClass.GRAD, st.numel)

    def _land_grad(self, st: SegmentState, grad: torch.Tensor, ring: LandingRing, *,
                   final: bool) -> None:
        """Send this action's gradient towards the optimizer's tier, adding it into host RAM
        through the step's `ring`; on the step's last contribution, record the segment's norm."""
        path = grad_landing(st.tier, st.placement.gradient_tier, written=st.grad_written,
                            final=final)
        if not transient_grad(st.tier, st.frozen):  # accumulated in place on the device
            if final:
                self._grad_complete(st, grad)
            return
        what = f"grad {st.seg.name}"
        if path.to_host:  # host state, or disk state's held gradient
            # On the landing worker, so the training thread goes on issuing the backward: the
            # copies wait for the gradient (an event now), the adds for their copies; the sync
            # and the norm read the host sum once `_drain_landings` has seen it done. One
            # landing at a time is in flight: the one before is waited for here, after this
            # action's compute was issued, so it ran under it; its gradient leaves the device
            # ledger now (the planner's replay holds it as long: `_CountingStep.land`). The
            # ring is taken here, on this thread, in the order the replay takes it.
            self._drain_landings()
            ring.hold()
            done = self.dev.mark()
            self._landing = (self._lander.submit(self._add_landing, ring, st.grad, grad, done,
                                                 what), grad, st if final else None)
            return
        self._drain_landings()  # the file path below adds through the ring too
        # Disk: chunk by chunk through host staging. The gradient file holds the sum of this
        # step's earlier contributions (grad_written); the step's last contribution completes
        # the sum in the device buffer, where the sync and the norms read it whole, before the
        # pass that writes it out. The ring is taken before the passes' chunk sets, as the
        # replay takes it: the pinned arena then holds it below them, not in a hole they leave.
        if path.ring_numel(st.numel, self.chunk_numel):
            ring.hold()
        passes = list(path.passes)
        while passes and passes[0].back:  # the sum back on the device: compute reads it next
            p = passes.pop(0)
            self._grad_file_chunks(st, grad, ring, add=p.add, back=p.back)
        if final:
            self._grad_complete(st, grad)
            self._finish_syncs()  # the device buffer is written out and freed next
        st.grad_written = path.written
        # the passes into the file, on the landing worker (the backward goes on meanwhile)
        self._landing = (self._lander.submit(self._file_passes, st, grad, ring, passes), grad,
                         None)

    def _file_passes(self, st: SegmentState, grad: torch.Tensor, ring: LandingRing,
                     passes: list) -> None:
        for p in passes:
            self._grad_file_chunks(st, grad, ring, add=p.add, back=p.back)

    def _add_landing(self, ring: LandingRing, host: torch.Tensor, grad: torch.Tensor,
                     done: object, what: str) -> None:
        """`host += grad` through the ring, on the landing worker."""
        add_to_host(self.store, ring, host, grad, self.chunk_numel, what, after=[done])

    def _drain_landings(self) -> None:
        """The landing in flight has added its gradient into host RAM (a failed one raises
        here): its device gradient is freed, and its segment, if that was its step's last
        contribution, is complete."""
        if self._landing is None:
            return
        (fut, grad, st), self._landing = self._landing, None
        fut.result()
        self.store.free(Tier.DEVICE, TensorClass.GRAD, grad)
        if st is not None:
            self._grad_complete(st, st.grad)

    def _grad_file_chunks(
        self, st: SegmentState, grad: torch.Tensor, ring: LandingRing, *, add: bool, back: bool
    ) -> None:
        """Between the device gradient and its file, chunk by chunk: `add`: file + device
        (the order the earlier contributions were summed in), else the device's alone; `back`:
        the sum returns to the device buffer instead of the file."""
        what = f"grad {st.seg.name}"

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            staging, dev = bufs["grad"], grad.narrow(0, lo, bufs["grad"].numel())
            if add:
                add_to_host(self.store, ring, staging, dev, self.chunk_numel, what)
            else:  # the file write reads the staging buffer next
                self.store.wait_host(self.store.to_host(staging, dev, what))
            if back:
                copied = self.store.to_device(dev, staging, what)
                self.store.wait(copied)  # compute reads the sum
                self.store.wait_host(copied)  # before the staging buffer takes a later chunk

        stream_chunks(self.store, st, chunk_ranges(st.numel, self.chunk_numel),
                      read=("grad",) if add else (), write=() if back else ("grad",), step=step,
                      pinned=True)

    def _grad_complete(self, st: SegmentState, grad: torch.Tensor) -> None:
        """The segment's gradient for this step is all in: start its sync across ranks (a no-op
        in one process); `_finish_syncs` waits for it and takes the norms."""
        self._syncing.append((st, grad, self.opts.grad_sync.start(st.seg.name, grad,
                                                                   st.layout.slots)))

    def _finish_syncs(self) -> None:
        self._drain_landings()
        for st, grad, pending in self._syncing:
            pending.wait()
            self._record_norms(st, grad)
        self._syncing.clear()

    def _record_norms(self, st: SegmentState, grad: torch.Tensor) -> None:
        """Per-parameter gradient norms, each kept where its gradient is (host-state segments'
        in host memory: a copy to the device per parameter would block the training thread
        until the device's queue drained, each time). The global norm is the norm of these,
        stacked in the reference optimizer's parameter order, so clipping matches it bit for
        bit (`_finish_step`)."""
        for name, view in st.layout.views(grad).items():
            self.param_norms[name] = torch.linalg.vector_norm(view)

    # -- update ----

    def _finish_step(self, lr: float) -> tuple[float, float, bool]:
        """Clip and update, or skip a non-finite step: (the step's loss, the global gradient
        norm, whether the step was skipped)."""
        self._finish_syncs()
        total = torch.linalg.vector_norm(
            _stack_on(self.device, [self.param_norms[n] for n in self.norm_order]))
        max_norm = self.opts.grad_clip if self.opts.grad_clip > 0 else math.inf
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # The step's one host read of the device: the global norm, with the clipping
        # coefficient the host-state updates scale by and the step's loss, in one vector
        # (fp32 values widen to fp64 exactly). Invariant: the CPU update may write the pinned
        # masters only after this read. The updates of host state are submitted below, once
        # the norm is known, and the next upload of those masters reads them only after their
        # update (`_wait_update` before `_weights`).
        grad_norm, coef_value, loss = self.dev.read(
            torch.stack([total.double(), coef.double(), self.loss_sum]))
        self.cache.drop_all()  # every streamed copy is about to be stale
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
            for st in self.trainable:
                if st.grad is not None:
                    st.grad.zero_()
                st.grad_written = False
            for read in self._readahead.values():  # nothing to update: the reads are dropped
                free_copies(self.store, read.st, read.buffers())
            self._readahead.clear()
            return loss, grad_norm, True
        host_coef = torch.tensor(coef_value, dtype=coef.dtype)  # exact: an fp32 value
        for st in self.trainable:
            if st.tier == Tier.DEVICE:
                with self.clock.measure(f"update {st.seg.name}"):
                    self._update(st, coef, lr)
            else:
                self._updates[st.index] = self._worker.submit(self._update, st, host_coef, lr)
                if st.placement.resident:
                    st.device_stale = True
        return loss, grad_norm, False

    def _update(self, st: SegmentState, coef: torch.Tensor, lr: float) -> None:
        slots = [s.name for s in st.slots]

        # what the simulated device prices a CPU update at (a device one is a compute region)
        def cpu(params: float) -> contextlib.AbstractContextManager[None]:
            if st.tier == Tier.DEVICE:
                return contextlib.nullcontext()
            return self.dev.cpu_work(f"update {st.seg.name}", params=params)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            """The optimizer on elements [lo, lo + n) of the segment (all of it, off the disk
            tier)."""
            with cpu(bufs["grad"].numel() * self.optimizer.cpu_cost):
                bufs["grad"].mul_(coef)
                self.optimizer.update_range(st.layout, lo, bufs["master"], bufs["grad"],
                                            {c: bufs[c] for c in slots}, st.steps, lr)
            if st.tier == Tier.DISK and st.compute_format is not None:  # the whole master
                self.compute_copies.refresh(self.store, st, bufs["master"])

        lane = "device update" if st.tier == Tier.DEVICE else "cpu update"
        with self.tracer.span(lane, f"update {st.seg.name}", cat="update", tier=str(st.tier)):
            if st.tier == Tier.DISK:
                self._update_disk(st, step)
            else:
                step(0, {c: st.buffer(c) for c in (*st.state_copies, "grad")})
                self.compute_copies.refresh(self.store, st, st.master)  # quantised once a step
                st.grad.zero_()
            advance(st.steps)

    def _update_disk(self, st: SegmentState, step: Callable[[int, dict], None]) -> None:
        """A disk-tier update: the copies not already in host RAM (the read-ahead's master and
        slots, a gradient held on the host) are staged in chunks, the next chunk read while this
        one updates; the gradient is spent, only master and slots go back to their files.
        An update of one chunk (a compute copy's segment, or a small one) defers their
        write-back (`_update_whole`)."""
        self._writer.wait(st.index)  # the last step's write-back of its files has landed
        ahead = self._readahead.pop(st.index, None)
        held = {} if ahead is None else dict(ahead.buffers())
        if st.grad is not None:
            held["grad"] = st.grad
        ranges = self._update_ranges(st)
        if self.opts.writeback is not None and len(ranges) == 1:
            self._update_whole(st, step, held)
            return
        ends = {lo: lo + n for lo, n in ranges}

        def chunk(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            for c, buf in held.items():
                a, b = st.slot(c).range(st.layout, lo, ends[lo])
                bufs[c] = buf[a:b]
            step(lo, bufs)

        stream_chunks(self.store, st, ranges,
                      read=tuple(c for c in (*st.state_copies, "grad") if c not in held),
                      write=tuple(c for c in st.state_copies if c not in held), step=chunk)
        if ahead is not None:
            write_back_copies(self.store, st, ahead.bufs)  # and frees the staging
        if st.grad is not None:
            st.grad.zero_()

    def _update_whole(self, st: SegmentState, step: Callable[[int, dict], None],
                      held: dict[str, torch.Tensor]) -> None:
        """A disk-tier update in one chunk with its write-back deferred: the copies not in RAM
        are read whole, the optimizer runs (and writes the compute file), the fp32 master is
        written now where the forward reads it, and the rest goes to the writer, which frees
        the staging once written (tierlm.runtime.writeback)."""
        self._writer.make_room()
        missing = tuple(c for c in (*st.state_copies, "grad") if c not in held)
        bufs = {**read_copies(self.store, st, missing), **held}
        step(0, bufs)
        if st.grad is not None:  # held on the host: the next step accumulates into it
            st.grad.zero_()
        elif "grad" in bufs:  # staged from its file: spent
            self.store.free(Tier.HOST, TensorClass.STAGING, bufs["grad"])
        later = deferred_copies(st.state_copies, st.compute_format is not None)
        write_back_copies(self.store, st, {c: bufs[c] for c in st.state_copies
                                           if c not in later})
        self._writer.submit(st, {c: bufs[c] for c in later})

    # -- evaluation and state ----

    def _streamed_head(
        self, ids: torch.Tensor, read, positions: torch.Tensor | None = None
    ) -> object:
        """One forward of `ids` outside training, streaming the segments as the step does:
        `read(views, hn)` is called under autocast with the head's parameter views and its
        normed input (B, T, D); its result is returned. `positions`: see tierlm.data.batch."""
        self.synchronize()
        n = len(self.states)
        actions = [Action("fwd", s, (0,)) for s in range(n - 1)] + [Action("head", n - 1, (0,))]
        self.cache.begin([self._needs(a) for a in actions])
        h, ctx = ids, self.adapter.embed_context(ids, positions)
        with self._outside_training():
            for k, a in enumerate(actions):
                st = self.states[a.seg]
                w = self._weights(k, a.seg)
                w = self._trained_flat(a.seg, w)
                with self.opts.autocast():
                    if a.kind == "fwd":
                        h = st.seg.forward(self._param_views(a.seg, w), h, ctx)
                        if a.seg == 0:
                            ctx = self.adapter.context(ids, h, positions)
                    else:
                        views = self._views(k, a.seg, w)
                        out = read(views, st.seg.forward(views, h, ctx))
        self.cache.drop_all()
        return out

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of one (B, T+1) batch, streaming weights as the step does."""
        ids, targets = (t.to(self.device) for t in inputs_and_targets(batch))
        head = self.states[-1].seg
        t = targets.flatten()
        step = self.chunk_tokens

        def loss_sum(views, hn) -> float:
            hn = hn.flatten(0, 1)  # (B*T, D)
            return sum(
                F.cross_entropy(head.project(views, hn[c : c + step]).float(), t[c : c + step],
                                reduction="sum").item()
                for c in range(0, t.numel(), step)
            )

        positions = _to(position_ids(batch), self.device)
        return self._streamed_head(ids, loss_sum, positions) / trained_targets(batch)

    @torch.no_grad()
    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(V,) fp32 logits after the last token of `ids` (1, T), projecting only the last
        position (sampling never builds the whole model)."""
        head = self.states[-1].seg
        return self._streamed_head(
            ids.to(self.device), lambda views, hn: head.project(views, hn[0, -1:])[0].float()
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """Current fp32 weights by the model's parameter names (CPU copies): the trained ones
        (a LoRA run's adapters; its frozen base: `frozen_weights`)."""
        return self._named(("master",))

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """The frozen base's weights by parameter name (CPU copies; empty when all is trained;
        an NF4 base's decoded)."""
        if not self.frozen_base:
            return {}
        out = self._named(("master",), [st for st in self.states if st.compute_format is None])
        for st in self.states:
            if st.compute_format is not None:
                out.update(self.compute_copies.weights(self.store, st))
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state by parameter name (`<name>.<slot>` in the slot's checkpoint shape,
        and `<name>.step`), the keys the reference trainer writes for the same optimizer, so
        either runtime resumes the other's checkpoint."""
        return self._named(tuple(s.name for s in self.optimizer.slots))

    def _named(self, copies: tuple[str, ...], states: list[SegmentState] | None = None
               ) -> dict[str, torch.Tensor]:
        self.synchronize()
        out = {}
        for st in self.trainable if states is None else states:
            bufs = read_copies(self.store, st, copies)
            for copy in copies:
                for name, view in _parts(st, copy, bufs[copy]).items():
                    key = name if copy == "master" else f"{name}.{copy}"
                    out[key] = view.detach().to("cpu", copy=True)
            free_copies(self.store, st, bufs)
            if copies != ("master",):
                out.update({k: v.detach().to("cpu", copy=True)
                            for k, v in self._step_counters(st).items()})
        return out

    def load(self, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> None:
        """Restore weights and optimizer state written by `weights`/`optimizer_state` (or by
        the reference trainer)."""
        self.synchronize()
        for st in self.trainable:
            if st.tier == Tier.DISK:
                self._load_disk(st, weights, optim)
                continue
            bufs = read_copies(self.store, st, st.state_copies)
            st.layout.pack(weights, bufs["master"])
            self.compute_copies.refresh(self.store, st, bufs["master"])
            if optim:
                for slot in st.slots:
                    slot.pack(st.layout, _Suffixed(optim, f".{slot.name}"), bufs[slot.name])
                self._restore_counters(st, optim)
            write_back_copies(self.store, st, bufs)
            if st.device_weights is not None and st.device_weights is not st.master:
                st.device_stale = True
        self.cache.drop_all()

    def _load_disk(
        self, st: SegmentState, weights: Mapping[str, torch.Tensor],
        optim: Mapping[str, torch.Tensor],
    ) -> None:
        """`load` for a disk-tier segment: its files are rewritten chunk by chunk from the
        (lazy) mappings, each tensor looked up once; a segment with a compute copy is one chunk
        (its fp8 scales need whole tensors). Without optimizer state the slots are kept."""
        sources = {"master": LookupOnce(weights)}
        if optim:
            for slot in st.slots:
                sources[slot.name] = LookupOnce(_Suffixed(optim, f".{slot.name}"))
        kept = () if optim else tuple(s.name for s in st.slots)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            st.layout.pack(sources["master"], bufs["master"], lo)
            for slot in st.slots if optim else ():
                a, _ = slot.range(st.layout, lo, lo + bufs["master"].numel())
                slot.pack(st.layout, sources[slot.name], bufs[slot.name], a)
            if st.compute_format is not None:
                self.compute_copies.refresh(self.store, st, bufs["master"])

        stream_chunks(self.store, st, self._update_ranges(st), read=kept,
                      write=st.state_copies, step=step)
        if optim:
            self._restore_counters(st, optim)
        if st.device_weights is not None:
            st.device_stale = True

    def state_shards(
        self,
    ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """(segment name, weights, optimizer state) one segment at a time, keyed like `weights`
        and `optimizer_state`, so a checkpoint never holds the whole model in RAM. The tensors
        are views of the state or of staging buffers, valid until the next shard is asked for."""
        self.synchronize()
        for st in self.trainable:
            slots = tuple(s.name for s in st.slots)
            if st.tier == Tier.DISK:  # read parameter by parameter as the writer asks
                weights = DiskTensor.of(self.store, st, "master")
                optim = {f"{name}.{c}": t for c in slots
                         for name, t in DiskTensor.of(self.store, st, c).items()}
                yield st.seg.name, weights, {**optim, **self._step_counters(st)}
                continue
            bufs = read_copies(self.store, st, st.state_copies)
            try:
                optim = {f"{name}.{c}": view for c in slots
                         for name, view in _parts(st, c, bufs[c]).items()}
                optim.update(self._step_counters(st))
                yield st.seg.name, st.layout.views(bufs["master"]), optim
            finally:
                free_copies(self.store, st, bufs)

    def _update_ranges(self, st: SegmentState) -> list[tuple[int, int]]:
        """Chunks in which a disk segment's state is rewritten: the whole segment where it has
        a compute copy (its fp8 scales come from whole tensors), else staging chunks cut where
        the optimizer's slots can be cut (whole segments for an optimizer with align 0)."""
        if st.compute_format is not None:
            return [(0, st.numel)]
        return self.optimizer.chunk_ranges(st.layout, self.chunk_numel)

    @staticmethod
    def _restore_counters(st: SegmentState, optim: Mapping[str, torch.Tensor]) -> None:
        """Each optimizer group's step counter from a checkpoint (keyed per parameter)."""
        for (_, _, decay), counter in zip(st.layout.groups(), st.steps, strict=True):
            first = next(s.name for s in st.layout.slots if s.decay == decay)
            counter.copy_(optim[f"{first}.step"])

    @staticmethod
    def _step_counters(st: SegmentState) -> dict[str, torch.Tensor]:
        """Each parameter's optimizer step counter (one per optimizer group)."""
        out = {}
        for (_, _, decay), step in zip(st.layout.groups(), st.steps, strict=True):
            for slot in st.layout.slots:
                if slot.decay == decay:
                    out[f"{slot.name}.step"] = step
        return out

    def close(self) -> None:
        self.synchronize()
        self._worker.shutdown(wait=True)
        self._lander.shutdown(wait=True)
        self._writer.close()
        self.store.close()


class _TensorStep:
    """One `Engine.step` as the walk's backend (tierlm.runtime.walk): the engine's compute,
    stores and copies on the step's micro-batches; the walk says when."""

    def __init__(self, eng: Engine, mbs: list[_MicroBatch], actions: list[Action],
                 names: list[str], ring: LandingRing, divisor: float) -> None:
        self.eng, self.mbs, self.actions, self.names = eng, mbs, actions, names
        self.ring = ring  # the step's landing ring
        self.divisor = divisor  # of the step's summed token loss

    def begin(self, k: int, a: Action) -> None:
        self.eng._bring_back(self.actions[k + 1 : k + 2], self.mbs)

    def weights(self, k: int, s: int) -> torch.Tensor:
        return self.eng._weights(k, s)

    def running(self, k: int, a: Action) -> contextlib.AbstractContextManager:
        return self.eng.tracer.span("step", a.label(self.names), cat="action", k=k)

    def prefetch(self, k: int) -> None:
        self.eng.cache.reads_done(k - 1)  # the action just issued was the last to read them
        self.eng.cache.prefetch(k)

    def read_ahead(self, s: int) -> None:
        eng = self.eng
        st = eng.states[s]
        eng._writer.wait(s)  # the last update's write-back of them has landed
        eng._readahead[s] = CopiesRead(eng.store, st, st.state_copies)

    def forward(self, a: Action, w: torch.Tensor, xs: list[torch.Tensor | None]
                ) -> Iterator[torch.Tensor]:
        return self.eng._forward(a, [(self.mbs[i], x) for i, x in zip(a.mbs, xs, strict=True)],
                                 w)

    def head(self, k: int, a: Action, i: int, w: torch.Tensor, x: torch.Tensor,
             grad: torch.Tensor, tied: torch.Tensor | None) -> torch.Tensor:
        loss, dx = self.eng._head(k, self.mbs[i], self.divisor, w, x, grad, tied)
        self.eng.loss_sum += loss  # on the device; read once, at the step's end
        return dx

    def backward(self, a: Action, i: int, w: torch.Tensor, x: torch.Tensor | None,
                 gout: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return self.eng._backward(a.seg, self.mbs[i], w, x, gout, grad)

    def hold(self, t: torch.Tensor, boundary: int | None) -> None:
        ledger = self.eng.ledger
        ledger.allocate(Tier.DEVICE, TensorClass.ACTIVATION, nbytes_of(t))
        if boundary is not None:
            ledger.hold_activation(self.names[boundary], "boundary", nbytes_of(t))

    def drop(self, t: torch.Tensor, boundary: int | None) -> None:
        ledger = self.eng.ledger
        if boundary is not None:
            ledger.release_activation(self.names[boundary], "boundary", nbytes_of(t))
        ledger.release(Tier.DEVICE, TensorClass.ACTIVATION, nbytes_of(t))

    def park(self, s: int, x: torch.Tensor) -> tuple[torch.Tensor, object, torch.Size]:
        """The input's flat host copy, the copy's event and the input's shape."""
        store = self.eng.store
        host = store.alloc(Tier.HOST, TensorClass.ACTIVATION, x.numel(), x.dtype, pinned=True)
        copied = store.to_host(host.view(x.shape), x, f"boundary {self.names[s]}")
        return host, copied, x.shape

    def wait_parked(self, copy: tuple[torch.Tensor, object, torch.Size]) -> None:
        self.eng.store.wait(copy[1])

    def unpark(self, s: int, copy: tuple[torch.Tensor, object, torch.Size]) -> torch.Tensor:
        store = self.eng.store
        host, _, shape = copy
        dev = torch.empty(shape, dtype=host.dtype, device=self.eng.device)
        store.wait(store.to_device(dev, host.view(shape), f"boundary {self.names[s]}"))
        # the pinned arena holds its range back until the copy reading it has finished
        # (Store.free records the copies queued so far)
        store.free(Tier.HOST, TensorClass.ACTIVATION, host)
        return dev

    def grad_buffer(self, s: int) -> torch.Tensor:
        with self.eng.tracer.span("step", "gradient buffer", cat="step"):
            return self.eng._grad_target(s)

    def tied_grad(self) -> torch.Tensor:
        owner = self.eng.states[0]  # the embedding owns every tie
        return self.eng.store.zeros(Tier.DEVICE, TensorClass.GRAD, owner.numel)

    def add_grad(self, grad: torch.Tensor, part: torch.Tensor) -> None:
        grad.add_(part)
        self.eng.store.free(Tier.DEVICE, TensorClass.GRAD, part)

    def land(self, s: int, grad: torch.Tensor, final: bool) -> None:
        trained = self.eng.trained[s]
        if trained is not None:
            self.eng._land_grad(trained, grad, self.ring, final=final)


def _parts(st: SegmentState, copy: str, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameter name -> its part of a flat copy in checkpoint shape (parameters owning none of
    a slot, e.g. a vector's factored statistics, left out, as the reference has no key)."""
    if copy == "master":
        return st.layout.views(buf)
    slot = st.slot(copy)
    return {p.name: v for p, v in zip(st.layout.slots, slot.views(st.layout, buf).values(),
                                      strict=True) if slot.param_numel(p)}


def _stack_on(device: torch.device, scalars: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack of 0-dim tensors on `device`, in their order. Those elsewhere (host-state
    segments' norms, in host memory) cross as one vector: a blocking copy each would wait for
    the device's queue each time."""
    away = [i for i, t in enumerate(scalars) if t.device.type != device.type]
    if away:
        moved = torch.stack([scalars[i] for i in away]).to(device)
        scalars = list(scalars)
        for j, i in enumerate(away):
            scalars[i] = moved[j]
    return torch.stack(scalars)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


class _Suffixed(Mapping[str, torch.Tensor]):
    """`source[name + suffix]` as `view[name]`, looked up only when asked (a checkpoint's
    optimizer state is a lazy mapping keyed `<parameter>.<slot>`)."""

    def __init__(self, source: Mapping[str, torch.Tensor], suffix: str) -> None:
        self.source, self.suffix = source, suffix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source[name + self.suffix]

    def __iter__(self) -> Iterator[str]:
        n = len(self.suffix)
        return (k[:-n] for k in self.source if k.endswith(self.suffix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def build_engine(
    model: torch.nn.Module,
    optim: OptimConfig,
    options: EngineOptions,
    *,
    device: torch.device,
    store: Store | None = None,
    initial_weights: InitialWeights = module_weights,
) -> Engine:
    """The engine of the plan `plan_step` chooses from `options` (tierlm.runtime.plan)."""
    plan = plan_step(model, optim, options, device=device, initial_weights=initial_weights)
    return Engine(model, optim, plan, device=device, store=store,
                  initial_weights=initial_weights)

"""The tiered step (ARCHITECTURE.md section 3).

The engine executes one StepPlan (tierlm.runtime.plan), which says where each segment's state
lives and which activation policy it runs; it chooses nothing of its own. One optimizer step
over M micro-batches runs a precomputed list of actions:

    forward(segment, micro-batches)  ->  head(micro-batches)  ->  backward(segment, micro-batches)

`microbatch-outer` repeats the whole list per micro-batch; `layer-outer` runs each segment for all
micro-batches while its weights are on the device. Because the list is known before the step
starts, the stream cache evicts by next use and prefetches the next action's weights, and a
resident copy an update made stale is refreshed while the action before its first use runs
(`SegmentCompute._refresh_ahead`). The order in which an action waits for, holds, parks,
drops and lands what it touches is tierlm.runtime.walk's, which the planner's replay walks too,
over byte counts.

After the backward sweep the global gradient norm is known: the step is skipped on a non-finite
norm, otherwise gradients are clipped and each segment is updated on the tier that holds its
state. Host and disk updates run on a background worker in forward order, overlapping the next
step's forward: segment i's forward waits only for segment i's update. A disk-tier segment may
hold its gradient in host RAM (its placement's `grad_tier`), and the last group's backward may
read its master and slots ahead of the update (`EngineOptions.readahead`,
tierlm.runtime.readahead), and a disk-tier update ends once what the next forward reads is on
disk, its master and slots written back behind the step by one more thread
(`EngineOptions.writeback`, tierlm.runtime.writeback).

This module holds the Engine's setup, its step and the step's finish (syncs, norm, clipping, the
updates' dispatch). Its other parts are classes it is built from, one file each:
tierlm.runtime.compute (the actions' weights and compute), tierlm.runtime.gradients (landing and
syncs), tierlm.runtime.update (the updates), tierlm.runtime.engine_schedule (the schedule's rules
on its segments), tierlm.runtime.evaluation and tierlm.runtime.state_io (outside the step);
tierlm.runtime.segments places each segment's state at setup.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from tierlm.activations import PolicyFactory
from tierlm.config import OptimConfig
from tierlm.data.batch import IGNORE_INDEX, inputs_and_targets, position_ids
from tierlm.memory.arena import PinnedBytes
from tierlm.memory.device import Device
from tierlm.memory.placement import PlacementReport
from tierlm.memory.store import Store, nbytes_of
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.cache import StreamCache, window_bytes
from tierlm.runtime.clock import compute_clock
from tierlm.runtime.compute import MicroBatch, SegmentCompute
from tierlm.runtime.costs import SegmentCost
from tierlm.runtime.engine_schedule import EngineSchedule
from tierlm.runtime.evaluation import Evaluation, eval_mode
from tierlm.runtime.grad_sync import NoSync
from tierlm.runtime.gradients import Gradients
from tierlm.runtime.landing import LandingRing
from tierlm.runtime.options import EngineOptions
from tierlm.runtime.parts import StepParts
from tierlm.runtime.pinned import step_pinned_bytes
from tierlm.runtime.plan import StepPlan, plan_step
from tierlm.runtime.schedule import Action, parked_inputs
from tierlm.runtime.segments import place_segments
from tierlm.runtime.state import (
    CopiesRead,
    InitialWeights,
    SegmentState,
    free_copies,
    module_weights,
    reserve_spare,
    start_load,
)
from tierlm.runtime.state_io import StateIO
from tierlm.runtime.stepper import Stepper
from tierlm.runtime.update import SpeculationCounts, Updates
from tierlm.runtime.walk import walk_step
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, Writer


class Engine(SegmentCompute, Gradients, Updates, EngineSchedule, Evaluation, StateIO, Stepper):
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
        self.optimizer = parts.optimizer
        options.grad_sync.check_optimizer(self.optimizer)
        if options.speculative_updates and not isinstance(options.grad_sync, NoSync):
            # a speculation reads the landed gradient before the sync across ranks has
            # averaged it
            raise ValueError("speculative updates (--speculative-update) need one process: "
                             "pass --speculative-update off with a gradient sync across ranks")
        if options.held_gradients < 1:  # a landing would wait for a speculation not issued
            raise ValueError(f"held_gradients must be at least 1, got {options.held_gradients}")
        self.has_dropout = any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
        ) or float(getattr(model.config, "attention_dropout", 0) or 0) > 0
        # held-out loss and sampling without dropout; a model without any keeps its modules'
        # mode (a compiled block would compile once more for eval mode, for nothing)
        self._outside_training: Callable[[], contextlib.AbstractContextManager] = (
            functools.partial(eval_mode, model) if self.has_dropout else contextlib.nullcontext)

        segs = self.adapter.segments
        self.index = {s.name: i for i, s in enumerate(segs)}
        self.frozen_base = parts.frozen_base
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
        # offloaded saved tensors are cut from the store's pinned arena
        self._make_policy = PolicyFactory(self.dev, dropout=self.has_dropout, store=self.store)
        # (batch size, seq len) -> segment -> the host buffers (bytes, in order) its `offload`
        # run takes per micro-batch: the plan's probe, then what steps took (_learn_offload_sizes)
        self._offload_sizes: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {
            (options.batch_size, options.seq_len): {
                s: sizes for s, sizes in enumerate(plan.offload_bytes) if sizes}}
        self._offload_shape: tuple[int, int] | None = None  # the last step's rows
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
        # per segment: its state, the state the optimizer updates, its frozen weights' copy
        self.states, self.trained, self.frozen = place_segments(
            self.store, parts, self.report.placements, initial_weights, device=device,
            update_ranges=self._update_ranges, node=options.node, optim=optim)
        for st in self.trainable:  # the files a speculation writes, on disk from the start
            if self._speculates(st):
                reserve_spare(self.store, st)
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
        # resident segment -> the refresh of its stale copy started ahead of its first use
        # (`_refresh_ahead`), until that use finishes it
        self._refreshing: dict[int, object] = {}
        # segment -> its speculative update this step: (future, the spare-generation state it
        # writes, its step counters before it) until `_finish_step` resolves it
        self._speculated: dict[int, tuple[Future, SegmentState, list[torch.Tensor]]] = {}
        # the latest speculations that took their gradient from host RAM (at most
        # EngineOptions.held_gradients; tierlm.runtime.schedule.held_before)
        self._kept: list[Future] = []
        self._lr = 0.0  # the step's learning rate (a speculation is issued mid-sweep)
        self.speculation = SpeculationCounts()  # the last step's (`_count_speculations`)
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

    def _size_cache(self) -> None:
        """Room for the largest streamed device copies (`window_bytes`), in the format their next
        refresh gives them (a layer switched from fp8 to bf16 grows its segment's copy)."""
        self.cache.capacity_bytes = window_bytes(
            self.compute_copies.nbytes(st) for st in self.states if not st.placement.resident)

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

    @property
    def engine(self) -> Engine:  # the placement the planner predicts is this one's
        return self

    def synchronize(self) -> None:
        """Wait for every pending optimizer update and write-back (before eval, checkpoints,
        export)."""
        for s in list(self._updates):
            self._wait_update(s)
        self._writer.drain()

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
            self._lr = lr
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
                mbs.append(MicroBatch(ids, targets, positions,
                                      ctx=self.adapter.embed_context(ids, positions)))
            # a step of a larger shape than planned (more micro-batches, longer rows) grows
            # the pinned arena's step region, between steps
            b, t = mbs[0].ids.shape
            self._learn_offload_sizes(b, t)
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
            # part of sweep_s spent waiting for weights: the host's waits, and on a GPU the
            # compute stream's (timed on the device: the host never blocks on those)
            "transfer_wait_s": self.transfer_wait_s + self.dev.take_wait_s(),
            "step_time_s": time.perf_counter() - t0,
            **self.dev.end_step(begun),  # a simulated device's step in virtual time
        }

    # -- the step's finish: syncs, norms, clipping, updates ----

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
        self._count_speculations(coef_value if math.isfinite(grad_norm) else None)
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
            for st in self.trainable:
                if st.index in self._speculated:  # dropped on the worker, behind it
                    self._updates[st.index] = self._worker.submit(self._resolve, st.index,
                                                                  None, lr)
                elif st.grad is not None:
                    st.grad.zero_()
                st.grad_written = False
            for read in self._readahead.values():  # nothing to update: the reads are dropped
                free_copies(self.store, read.st, read.buffers())
            self._readahead.clear()
            return loss, grad_norm, True
        host_coef = torch.tensor(coef_value, dtype=coef.dtype)  # exact: an fp32 value
        # The speculations (each resolved on the worker, behind it): kept at coefficient 1, a
        # commit that moves nothing, queued before the other updates so that no segment's
        # weights wait for an unrelated update to be free; redone below 1, in forward order
        # with the others, as without them.
        speculated = [st.index for st in self.trainable if st.index in self._speculated]
        if coef_value == 1.0:
            for s in speculated:
                self._updates[s] = self._worker.submit(self._resolve, s, host_coef, lr)
        for st in self.trainable:
            if st.tier == Tier.DEVICE:
                with self.clock.measure(f"update {st.seg.name}"):
                    self._update(st, coef, lr)
            else:
                if st.placement.remote:  # its network bytes, counted in this step
                    self._count_remote(st)
                if st.index not in speculated:
                    self._updates[st.index] = self._worker.submit(self._update, st, host_coef,
                                                                  lr)
                elif coef_value != 1.0:
                    self._updates[st.index] = self._worker.submit(self._resolve, st.index,
                                                                  host_coef, lr)
                if st.placement.resident:
                    st.device_stale = True
                    st.read_done = self.dev.mark()  # after the sweep's reads of its copy
        return loss, grad_norm, False

    def close(self) -> None:
        self.synchronize()
        self._worker.shutdown(wait=True)
        self._lander.shutdown(wait=True)
        self._writer.close()
        self.store.close()


class _TensorStep:
    """One `Engine.step` as the walk's backend (tierlm.runtime.walk): the engine's compute,
    stores and copies on the step's micro-batches; the walk says when."""

    def __init__(self, eng: Engine, mbs: list[MicroBatch], actions: list[Action],
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
        if k < len(self.actions):
            self.eng._refresh_ahead(self.actions[k])

    def read_ahead(self, s: int) -> None:
        eng = self.eng
        if s in eng._speculated:  # its speculation has read them already: nothing to read
            return
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

    def unpark(self, s: int, copy: tuple[torch.Tensor, object, torch.Size]
               ) -> tuple[torch.Tensor, object]:
        host, written, shape = copy
        dev = torch.empty(shape, dtype=host.dtype, device=self.eng.device)
        # into fresh device memory: after the compute queued so far (the memory may be an
        # activation it still reads) and the copy out
        return dev, self.eng.store.to_device(dev, host.view(shape), f"boundary {self.names[s]}",
                                             after=[written, self.eng.dev.mark()])

    def arrived(self, s: int, event: object) -> None:
        self.eng.store.wait(event, f"boundary {self.names[s]}")

    def release_parked(self, copy: tuple[torch.Tensor, object, torch.Size]) -> None:
        # the pinned arena holds its range back until the copy reading it has finished
        # (Store.free records the copies queued so far)
        self.eng.store.free(Tier.HOST, TensorClass.ACTIVATION, copy[0])

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

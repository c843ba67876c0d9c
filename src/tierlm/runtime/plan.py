"""The engine's one input: a step plan, and `plan_step`, which chooses it.

A StepPlan says where each segment's state and compute copy live (its placement), which
activation policy each segment runs, and, in its `options`, the micro-batch order, where
boundary inputs wait, the read-ahead and write-back, and the run's other knobs. The engine
executes it and chooses nothing. `plan_step` makes the choices from EngineOptions (a placement
policy or the planner's placements, an activation policy or dynamic's budget rule over probed
costs) with the byte rules of `StepParts`, the very sizes the engine builds its step from.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierlm.activations import (
    default_chunk_tokens,
    dynamic_reserve_bytes,
    head_workspace_bytes,
    probe_costs,
    resolve_policies,
)
from tierlm.activations.chunked_loss import sum_cross_entropy
from tierlm.activations.dynamic import SegmentCosts
from tierlm.config import ActivationConfig, NotSupportedYet, OptimConfig
from tierlm.distributed.context import WHOLE_SEQUENCE, WholeSequence, ZigzagShare
from tierlm.distributed.sync import NO_SYNC, GradSync
from tierlm.memory.device import Device
from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import (
    STAGING_CHUNK_NUMEL,
    KeepGraphs,
    PlacementReport,
    SegmentPlacement,
    keeps_graph,
)
from tierlm.memory.tiers import Tier
from tierlm.models.adapters import ModelAdapter
from tierlm.models.frozen import FrozenBase
from tierlm.monitor.trace import NO_TRACER, NoTracer, Tracer
from tierlm.optim import build_flat_optimizer
from tierlm.precision.streaming import ComputeCopies
from tierlm.runtime.pinned import step_pinned_bytes
from tierlm.runtime.placement import PlacementPolicy, place
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.schedule import (
    boundary_activation_bytes,
    micro_batches_in_flight,
    parked_inputs,
)
from tierlm.runtime.state import InitialWeights, module_weights
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, WriteBack


@dataclass(kw_only=True)
class EngineOptions:
    """What a tiered run asks for. `plan_step` reads the fields that choose (policy, resident,
    the budgets, placements, activations, keep_resident_activations, check_placement) and
    turns them into a StepPlan; the engine reads only the others, through the plan's
    `options`."""

    policy: PlacementPolicy | str = "none"
    """The placement policy (tierlm.runtime.placement: AllDevice, HostState, DiskState, Tiered,
    or the planner's tierlm.plan.policy.Auto), or its --offload-policy name."""
    microbatch_order: str = "microbatch-outer"
    """microbatch-outer or layer-outer."""
    resident: str | None = None
    """Regex of segment names whose compute weights stay on the device."""
    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    disk_budget_bytes: int | None = None
    """What the disk tier may hold (--disk-budget); None: no limit beyond the free space."""
    activation_budget_bytes: int | None = None
    """Device bytes `dynamic` may spend on activations beyond what the ledger holds (a plan's
    device budget less its ledger peak); None: the device budget less the placement."""
    offload_dir: str | None = None
    placements: list[SegmentPlacement] | None = None
    """A placement per segment chosen by the planner; None: derive it from `policy`."""
    grad_clip: float = 1.0
    """Global-norm clipping bound; 0 disables it."""
    loss_chunk_tokens: int | None = None
    """Tokens per cross-entropy chunk at the head; None: ~16M logits per chunk."""
    chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = sum_cross_entropy
    """(logits, targets) -> a chunk's summed loss at the head: the compiled one under
    --compile segments (tierlm.runtime.compile); the blocks compile in the model itself."""
    batch_size: int = 1
    seq_len: int = 1
    micro_batches: int = 1
    """Shape of the step, for the activation reserve in the placement."""
    activations: ActivationConfig | None = None
    """Activation policy per segment (tierlm.activations); None: the planner's choice in
    keep_resident_activations (True: resident segments keep their graph, streamed ones
    recompute; False: every segment recomputes; a flag per segment: those that keep)."""
    keep_resident_activations: KeepGraphs = True
    boundary_tier: Tier = Tier.DEVICE
    """Where a segment's boundary input waits between its forward and its backward: on the
    device, or in host RAM (copied there as it is produced, dropped from the device once the
    segment's forward has read it, brought back for its backward). On host, layer-outer holds
    two segments' micro-batches on the device instead of every segment's. Needs the `full`
    activation policy, or `dynamic`, which parks the inputs of the segments it recomputes: a
    kept graph pins its input on the device."""
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    check_placement: Callable[[PlacementReport], None] = lambda report: None
    """Called with the placement before anything is allocated or written (the trainer's
    free-space and host-memory checks refuse an impossible run here)."""
    grad_sync: GradSync = NO_SYNC
    """Data parallelism (tierlm.distributed): started on each segment's complete gradient,
    overlapping the rest of the backward, and waited for before the norm is taken."""
    sequence_share: WholeSequence | ZigzagShare = WHOLE_SEQUENCE
    """The tokens of each row this rank trains on (context parallel: its zig-zag share, and the
    ring its attention runs over)."""
    tracer: Tracer | NoTracer = NO_TRACER
    """The step timeline (tierlm.monitor.trace): actions, waits, copies, disk requests and
    updates, recorded while the trainer arms it for --monitor.trace_step."""
    staging_chunk_numel: int = STAGING_CHUNK_NUMEL
    """fp32 elements per chunk in which disk-tier state crosses host staging (a multiple of
    1024, so chunk offsets suit O_DIRECT)."""
    base_format: str = "fp32"
    """How a frozen base (--finetune lora/qlora) is held, moved and read: fp32 (its master),
    bf16 (--finetune lora under bf16: its compute copy alone), or nf4 (--finetune qlora:
    each base layer decodes its weight on the device per matmul); tierlm.models.frozen."""
    readahead: ReadAhead | None = None
    """Read disk-tier segments' master and slots into host staging during the backward, so the
    update finds them in RAM (tierlm.runtime.readahead; the planner sets it); None: off."""
    writeback: WriteBack | None = DEFAULT_WRITEBACK
    """Write a disk-tier segment's master and slots back behind the step, its update ending
    once its compute copy (or, computing from fp32, its master) is on disk; at most
    `segments` write-backs pending (tierlm.runtime.writeback; the planner sets it). None: the
    update writes everything back before it ends."""


class StepParts:
    """What a model's step is built from, and the sizes the plan and the engine both take from
    it: the segments, their flat layouts, the compute copies and the flat optimizer, and the
    device bytes the step holds besides model state (boundary activations, tied gradients, a
    frozen base's adapters and decode buffer, the head's workspace)."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig,
                 options: EngineOptions) -> None:
        chunk = options.staging_chunk_numel
        if chunk <= 0 or chunk % 1024:
            raise ValueError(f"staging_chunk_numel must be a positive multiple of 1024 (4 KiB "
                             f"of fp32, O_DIRECT's alignment), got {chunk}")
        self.adapter = ModelAdapter(model)
        segs = self.adapter.segments
        # weights whose state is off the device are held, moved and computed from in the
        # precision they compute in (tierlm.precision.streaming); a LoRA base in its bf16
        # compute copy or NF4 bytes alone, on every tier (tierlm.models.frozen)
        self.frozen_copy = options.base_format != "fp32"
        self.compute_copies = (FrozenBase(model, options.base_format) if self.frozen_copy
                               else ComputeCopies(model))
        self.optimizer = build_flat_optimizer(optim)
        # Frozen parameters (requires_grad False: a LoRA run's base) are streamed weights with
        # no gradient and no optimizer state; the trained ones (its adapters) then live on the
        # device, a small flat layout per segment. Without frozen parameters the segment's
        # streamed weights are what is trained.
        self.frozen_base = any(not p.requires_grad for s in segs for _, p, _ in s.params)
        self.layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params
                                    if not (self.frozen_base and p.requires_grad)])
                        for s in segs]
        self.trained_layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params
                                            if p.requires_grad]) for s in segs]
        trained_bytes = sum(
            (4 + 4) * lay.numel + self.optimizer.state_nbytes(lay)
            for lay in self.trained_layouts if lay.numel) if self.frozen_base else 0
        config = model.config
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.hidden_bytes = options.batch_size * options.seq_len * config.hidden_size * 4
        self.in_flight = micro_batches_in_flight(options.micro_batches,
                                                 options.microbatch_order)
        # the owner's gradient holding the head's contribution to tied weights, one per
        # micro-batch in flight (tierlm.runtime.walk)
        tied = any(n in segs[-1].borrowed for n, _, _ in segs[0].params)
        self.tied_trained = tied and not self.frozen_base  # frozen ties take no gradient
        tied_bytes = self.layouts[0].numel * 4 if self.tied_trained else 0
        # a QLoRA matmul decodes its NF4 weight into a buffer of its own, one weight at a time
        # (outside the ledger): room for the largest
        decoded_bytes = max((self.compute_copies.decoded_nbytes(lay) for lay in self.layouts),
                            default=0) if self.frozen_copy else 0
        self.host_boundaries = options.boundary_tier == Tier.HOST
        self.activation_bytes = (
            boundary_activation_bytes(
                len(segs), self.hidden_bytes, options.micro_batches, options.microbatch_order,
                on_host=self.host_boundaries,
            )
            + self.in_flight * tied_bytes
        )
        # device bytes placed before any model state, besides the activation policy's reserve
        self.fixed_device_bytes = self.activation_bytes + trained_bytes + decoded_bytes
        vocab = config.vocab_size
        self.chunk_tokens = options.loss_chunk_tokens or default_chunk_tokens(vocab)
        self.head_bytes = head_workspace_bytes(
            self.chunk_tokens, vocab, options.batch_size * options.seq_len, config.hidden_size)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The engine's one input: a placement per segment (`report.placements`, with the bytes
    per tier it predicts), an activation policy per segment but the head, and the run's
    options (micro-batch order, boundary tier, read-ahead, write-back, clipping, ...)."""

    options: EngineOptions
    report: PlacementReport
    activation_policies: tuple[str, ...]
    park_recomputed: bool = False
    """With host boundaries: park only the inputs of the segments that recompute (dynamic,
    whose kept graphs pin theirs on the device); otherwise every segment must recompute."""
    activation_costs: list[SegmentCosts] | None = None
    """Measured activation bytes per segment (dynamic only), for monitoring and re-choosing."""
    activation_reserve_bytes: int = 0
    """Device bytes the placement reserved for the activation policy (dynamic's minimum)."""

    @property
    def placements(self) -> list[SegmentPlacement]:
        return self.report.placements


def plan_step(
    model: torch.nn.Module,
    optim: OptimConfig,
    options: EngineOptions,
    *,
    device: torch.device | Device,
    initial_weights: InitialWeights = module_weights,
) -> StepPlan:
    """Choose the step's plan for `model`: its placement (`options.placements`, the planner's,
    or the placement policy's over the budgets) and activation policies (`dynamic` probes one
    block per policy on `initial_weights` and spends what the placement leaves of the device
    budget), then give the placement (with the pinned bytes the step will hold) to
    `options.check_placement` before anything is allocated."""
    parts = StepParts(model, optim, options)
    segs = parts.adapter.segments
    names = [s.name for s in segs]
    acts = options.activations or ActivationConfig(
        policy="none" if options.keep_resident_activations else "full"
    )
    dynamic = acts.policy == "dynamic"
    if parts.frozen_base and dynamic:
        raise NotSupportedYet("--grad-checkpointing dynamic with --finetune lora",
                              "its probe measures full-parameter segments; pick a policy")
    # the planner's placement comes with its activation rule (options.activations None: resident
    # segments keep or recompute as planned, streamed ones recompute)
    planned = options.activations is None
    costs = None

    def probe() -> list[SegmentCosts]:
        return probe_costs(
            segs[:-1], parts.layouts[:-1], initial_weights, parts.adapter.context,
            # the measurement runs on the tensors' device (a simulated GPU's are on the CPU)
            device=device.torch_device if isinstance(device, Device) else device,
            batch_size=options.batch_size, seq_len=options.seq_len,
            hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
            autocast=options.autocast,
        )

    if dynamic:
        costs = probe()
    # with host boundaries, `dynamic` parks the inputs of the segments it recomputes and
    # counts the others' inputs, which their graphs keep on the device, as their cost
    boundary_bytes = parts.hidden_bytes if parts.host_boundaries and dynamic else 0
    reserve = dynamic_reserve_bytes(
        acts.policy, costs, fallback=acts.dynamic_fallback, in_flight=parts.in_flight,
        head_bytes=parts.head_bytes, boundary_bytes=boundary_bytes,
    )
    report = place(
        names,
        [lay.numel for lay in parts.layouts],
        policy=options.policy,
        resident=options.resident,
        device_budget_bytes=options.device_budget_bytes,
        host_budget_bytes=options.host_budget_bytes,
        disk_budget_bytes=options.disk_budget_bytes,
        # the adapters of a frozen base and their optimizer state: on the device throughout
        activation_bytes=parts.fixed_device_bytes + reserve,
        placements=options.placements,
        copy_bytes=[parts.compute_copies.copy_nbytes(lay) for lay in parts.layouts],
        slot_bytes=[0 if parts.frozen_base else parts.optimizer.state_nbytes(lay)
                    for lay in parts.layouts],
        base_copy=parts.frozen_copy,
        whole_update=parts.optimizer.align == 0,
        frozen=parts.frozen_base,
        chunk_numel=options.staging_chunk_numel,
    )
    budget = options.device_budget_bytes
    activation_budget = options.activation_budget_bytes if (
        options.activation_budget_bytes is not None) else (
        None if budget is None else budget - report.device_bytes + reserve)
    streamed = any(not p.resident for p in report.placements[:-1])
    if (acts.policy == "none" and not planned and streamed and activation_budget is not None
            and not parts.frozen_base):
        # `none` keeps a streamed segment's graph where the budget holds it: measured as
        # `dynamic` measures (a LoRA base's segments are not probed: they recompute)
        costs = probe()
    # the planner's choice: resident segments, and streamed ones where it found room, keep
    keeps = keeps_graph(report.placements, options.keep_resident_activations) if planned else [
        p.resident for p in report.placements]
    policies = resolve_policies(
        acts.policy, acts.overrides, names[:-1], keeps[:-1],
        fallback=acts.dynamic_fallback, costs=costs, in_flight=parts.in_flight,
        budget_bytes=activation_budget, head_bytes=parts.head_bytes,
        # a LoRA base's streamed segments recompute as before (the probe measures
        # full-parameter segments only, so their kept graphs are not measured)
        boundary_bytes=boundary_bytes, planned=planned or parts.frozen_base,
    )
    # the host RAM the step pins (tierlm.runtime.pinned), which the engine's arena will hold
    report = dataclasses.replace(report, pinned=step_pinned_bytes(
        parts, report.placements, options, micro_batches=options.micro_batches,
        batch_size=options.batch_size, seq_len=options.seq_len,
        parked=parked_inputs(policies, parts.host_boundaries)))
    options.check_placement(report)
    return StepPlan(options=options, report=report, activation_policies=tuple(policies),
                    park_recomputed=dynamic, activation_costs=costs,
                    activation_reserve_bytes=reserve)


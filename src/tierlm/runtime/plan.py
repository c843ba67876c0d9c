"""The engine's one input: a step plan, and `plan_step`, which chooses it.

A StepPlan says where each segment's state and compute copy live (its placement), which
activation policy each segment runs, and, in its `options`, the micro-batch order, where
boundary inputs wait, the read-ahead and write-back, and the run's other knobs. The engine
executes it and chooses nothing. `plan_step` makes the choices from EngineOptions (a placement
policy or the planner's placements, an activation policy or dynamic's budget rule over probed
costs) with the byte rules of `StepParts`, the very sizes the engine builds its step from
(EngineOptions: tierlm.runtime.options; StepParts: tierlm.runtime.parts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tierlm.activations import dynamic_reserve_bytes, probe_costs, resolve_policies
from tierlm.activations.dynamic import SegmentCosts
from tierlm.config import ActivationConfig, NotSupportedYet, OptimConfig
from tierlm.memory.device import Device
from tierlm.memory.placement import PlacementReport, SegmentPlacement, keeps_graph
from tierlm.runtime.options import EngineOptions
from tierlm.runtime.parts import StepParts
from tierlm.runtime.pinned import offload_sizes, step_pinned_bytes
from tierlm.runtime.placement import place
from tierlm.runtime.schedule import parked_inputs
from tierlm.runtime.state import InitialWeights, module_weights


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
    offload_bytes: tuple[tuple[int, ...], ...] = ()
    """Per segment but the head, the host buffers (bytes, in order) `offload` takes from the
    pinned arena for one micro-batch (measured; () where a segment does not offload)."""

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
        remote=options.remote,
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
        spare=options.speculative_updates,
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
    if planned and not parts.frozen_base:  # the planner's offloaded segments, where it chose
        policies = planned_offload(policies, options.offload_graphs)
    # the host buffers offloaded saved tensors take, measured as dynamic's costs are (a LoRA
    # base's segments are not probed: the engine measures them in its first step and grows its
    # arena after it, Engine._learn_offload_sizes)
    offloaded = [p == "offload" for p in policies]
    offload_bytes = offload_sizes(
        parts, report.placements, offloaded, initial_weights, options,
        device=device.torch_device if isinstance(device, Device) else device,
    ) if any(offloaded) and not parts.frozen_base else ()
    # the host RAM the step pins (tierlm.runtime.pinned), which the engine's arena will hold
    report = dataclasses.replace(report, pinned=step_pinned_bytes(
        parts, report.placements, options, micro_batches=options.micro_batches,
        batch_size=options.batch_size, seq_len=options.seq_len,
        parked=parked_inputs(policies, parts.host_boundaries), offloaded=offload_bytes))
    options.check_placement(report)
    return StepPlan(options=options, report=report, activation_policies=tuple(policies),
                    park_recomputed=dynamic, activation_costs=costs,
                    activation_reserve_bytes=reserve, offload_bytes=offload_bytes)


def planned_offload(policies: list[str], offload: tuple[bool, ...]) -> list[str]:
    """`policies` with the segments the planner offloads (`offload`, a flag per segment, the
    head's included) on `offload`; only segments that would recompute take it (a kept graph
    stays on the device)."""
    if len(offload) not in (0, len(policies) + 1):
        raise ValueError(f"offload_graphs: a flag per segment ({len(policies) + 1}), got "
                         f"{len(offload)}")
    return ["offload" if off and p == "full" else p
            for p, off in zip(policies, offload, strict=False)] + policies[len(offload):]

"""`--offload-policy` as a typed policy: `Auto(plan)`, the planner's, beside the runtime's own
rules (tierlm.runtime.placement: AllDevice, HostState, DiskState, Tiered).

`Auto` lives here, above the runtime, because it reads a `Plan`: it places as the plan says
and turns the plan's other choices (micro-batch order, kept graphs, where boundary inputs
wait, read-ahead, write-back, speculative updates) into the engine's options in one place
(`engine_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from tierlm.config import Config
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.plan.inputs import plan_auto
from tierlm.plan.result import Plan
from tierlm.runtime.placement import PlacementPolicy, Planned, placement_policy
from tierlm.runtime.plan import EngineOptions

if TYPE_CHECKING:
    from tierlm.node.client import NodeHello


@dataclass(frozen=True)
class Auto(Planned):
    """`auto`: the planner's plan, which chose the placement and checked the budgets with its
    own, finer model (tierlm.plan.search)."""

    plan: Plan
    name: ClassVar[str] = "auto"

    def choose(self, names, numels, pinned, **_) -> list[SegmentPlacement]:
        return self.plan.placements

    def engine_options(self, options: EngineOptions) -> EngineOptions:
        p = self.plan
        acts = options.activations
        planned_graphs = acts is not None and acts.policy == "none" and not acts.overrides
        return replace(
            options, policy=self, microbatch_order=p.order,
            keep_resident_activations=p.keep_resident_activations,
            offload_graphs=p.offload_graphs,
            boundary_tier=Tier.HOST if p.boundary_on_host else Tier.DEVICE,
            readahead=p.readahead, writeback=p.writeback, speculative_updates=p.speculative,
            held_gradients=p.held_gradients,
            # no activation policy asked for: keep or recompute resident segments as planned
            activations=None if planned_graphs else acts,
            # the plan checked the budgets; the engine's coarser check would refuse its choice
            device_budget_bytes=None, host_budget_bytes=None, disk_budget_bytes=None,
            # without a budget `dynamic` would keep every graph: what the plan leaves of the device
            activation_budget_bytes=(
                p.budgets["device"] - p.device_peak_bytes
                if acts is not None and acts.policy == "dynamic"
                else options.activation_budget_bytes),
        )


def offload_policy(cfg: Config, model_config: Any, precision: str, *,
                   node: NodeHello | None = None) -> PlacementPolicy:
    """The policy `--offload-policy` names: the runtime's by name (PLACEMENT_POLICIES), or for
    `auto` the planner's plan for this model and precision (a PlacementError saying what fits
    when none does), on the memory node the run connected to (`node`, its handshake) if any."""
    if cfg.memory.offload_policy == Auto.name:  # the one policy that needs a plan made
        return Auto(plan_auto(cfg, model_config, precision, node=node))
    return placement_policy(cfg.memory.offload_policy)


def auto_plan(policy: PlacementPolicy) -> Plan | None:
    """The plan an `auto` policy carries; None for the runtime's rules."""
    return policy.plan if isinstance(policy, Auto) else None

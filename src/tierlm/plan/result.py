"""The planner's result: `Plan` (placements, order, predicted peaks and step time), the budgets a
plan may use (each less a safety margin) and the problems that make it not fit."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierlm.memory.hardware import GiB, HardwareProfile
from tierlm.memory.placement import (
    KeepGraphs,
    SegmentPlacement,
    gib,
)
from tierlm.memory.tiers import Tier
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, WriteBack

if TYPE_CHECKING:
    from tierlm.runtime.readahead import ReadAhead



SAFETY_MARGIN = 0.10  # of each budget, left free for fragmentation, the CUDA context, kernels


GPU_RESERVE_BYTES = 1 * GiB  # CUDA context + cuBLAS/cuDNN workspaces, outside the margin


@dataclass
class Plan:
    placements: list[SegmentPlacement]
    order: str
    keep_resident_activations: KeepGraphs
    """True: resident segments keep their graph, streamed ones recompute; False: every segment
    recomputes; a flag per segment: those that keep (`_keep_streamed`: streamed blocks too,
    where the device has room)."""
    # ledger-visible peaks (what the runtime's ledger will measure), per tier and tensor class
    device_peak_bytes: int
    host_peak_bytes: int
    disk_bytes: int
    device_by_class: dict[str, int]
    host_by_class: dict[str, int]
    disk_by_class: dict[str, int]
    workspace_bytes: int  # activation workspace inside segments, outside the ledger
    moved_bytes: dict[str, int]  # per step, per link
    times_s: dict[str, float]
    bottleneck: str
    tokens_per_s: float
    budgets: dict[str, int]
    fits: bool = True
    problems: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    boundary_on_host: bool = False  # boundary activations wait in host RAM for the backward
    # the update's master and slots of disk-tier segments read during the backward (None: off)
    readahead: ReadAhead | None = None
    readahead_segments: list[int] = field(default_factory=list)  # which ones, in update order
    # disk-tier master and slots written back behind the step (None: inside the update)
    writeback: WriteBack | None = DEFAULT_WRITEBACK
    # of the host bytes, those pinned for PCIe copies (arena footprints, tierlm.memory.arena):
    # the peak the replay holds at once, per class, and the arena the engine allocates for
    # them (the peak, and what the order of allocations leaves unusable between them)
    pinned_peak_bytes: int = 0
    pinned_arena_bytes: int = 0
    pinned_by_class: dict[str, int] = field(default_factory=dict)
    # what a memory node holds for the remote segments (tierlm.node: their master, slots,
    # gradient sum and compute copy, and its receive staging); 0: no remote segment
    remote_bytes: int = 0
    # per segment, those whose saved tensors wait in host RAM instead of being recomputed (the
    # planner's keep / offload / recompute choice: tierlm.plan.search._offload_streamed); ()
    # where none does
    offload_graphs: tuple[bool, ...] = ()
    # each disk-tier segment's update issued at its gradient's final landing into a second set
    # of files, kept where the clipping coefficient is 1 (EngineOptions.speculative_updates):
    # the files are in `disk_bytes`
    speculative: bool = False
    # speculative updates: the most gradients their final landings keep in host RAM for them
    # at once (EngineOptions.held_gradients), counted in `host_peak_bytes`
    held_gradients: int = 1

    @property
    def device_total_bytes(self) -> int:
        return self.device_peak_bytes + self.workspace_bytes

    @property
    def step_s(self) -> float:
        return self.times_s["step"]

    @property
    def step_over_bound(self) -> float:
        """The predicted step over its lower bound, the compute alone: 1.0 is compute-bound
        (a simulated step: over the simulated compute)."""
        t = self.times_s
        return t["step"] / t["simulated_compute" if "estimate" in t else "compute"]

    def resident_names(self) -> list[str]:
        return [n for n, p in zip(self.names, self.placements, strict=True) if p.resident]

    def tier_counts(self) -> dict[str, int]:
        counts = {t.value: 0 for t in Tier}
        for p in self.placements:
            counts[p.state_tier.value] += 1
        return counts

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["placements"] = [
            {"segment": n, "resident": p.resident, "state_tier": p.state_tier.value,
             "grad_tier": p.gradient_tier.value}
            for n, p in zip(self.names, self.placements, strict=True)
        ]
        d.pop("names")
        d.pop("numels")
        d["device_total_bytes"] = self.device_total_bytes
        d["step_over_bound"] = self.step_over_bound
        return json.loads(json.dumps(d, default=str))


def _problems(plan: Plan, budgets: dict[str, int]) -> list[str]:
    out = []
    if plan.device_total_bytes > budgets["device"]:
        short = plan.device_total_bytes - budgets["device"]
        out.append(f"device needs {gib(plan.device_total_bytes)} (state "
                   f"{gib(plan.device_peak_bytes)} + activation workspace "
                   f"{gib(plan.workspace_bytes)}), usable {gib(budgets['device'])}: "
                   f"{short:,} bytes ({gib(short)}) short")
    if plan.host_peak_bytes > budgets["host"]:
        out.append(f"host needs {gib(plan.host_peak_bytes)}, usable {gib(budgets['host'])}")
    if plan.disk_bytes > budgets["disk"]:
        out.append(f"disk needs {gib(plan.disk_bytes)}, usable {gib(budgets['disk'])}")
    if plan.remote_bytes > budgets.get("remote", 0):
        out.append(f"memory node needs {gib(plan.remote_bytes)}, usable "
                   f"{gib(budgets.get('remote', 0))} (--memory-node-memory)")
    return out


def usable_budgets(
    hw: HardwareProfile, *, device_budget: int | None = None, host_budget: int | None = None,
    margin: float = SAFETY_MARGIN,
) -> dict[str, int]:
    """Budgets the plan must fit: the explicit ones, or the hardware's sizes; less the margin
    (and, on a GPU, the CUDA context reserve)."""
    device = device_budget if device_budget is not None else hw.gpu_memory_bytes - (
        0 if hw.device_is_cpu else GPU_RESERVE_BYTES)
    host = host_budget if host_budget is not None else hw.host_memory_bytes
    budgets = {
        "device": int(device * (1 - margin)),
        "host": int(host * (1 - margin)),
        "disk": int(hw.disk_budget_bytes * (1 - margin)),
    }
    if hw.memory_node is not None:  # the node's own RAM, with the same margin
        budgets["remote"] = int(hw.memory_node.memory_bytes * (1 - margin))
    return budgets

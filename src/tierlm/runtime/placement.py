"""Placement policies and their accounting: the bytes each tier holds under a placement, by the
engine's own rules (tierlm.runtime.state.persistent_bytes, the stream cache's window, the
gradient landings), and `place`, which chooses placements by a typed policy
(`PLACEMENT_POLICIES`, by `--offload-policy` name) and checks them against the budgets:

- `AllDevice` (`none`): everything on the device (the reference layout, through the runtime).
- `HostState` (`host`): state in host RAM; compute weights streamed to the device, except
  `--resident` ones.
- `DiskState` (`disk`): state in files under `--offload-dir`; weights streamed from there.
- `Tiered` (`tiered`): fill the device (embed, head, then blocks from the last one backwards,
  as their backward comes soonest), then host RAM, then disk.
- `Planned` (`auto`): placements chosen elsewhere, only accounted and checked; the planner's
  policy, which carries its plan, is tierlm.plan.policy.Auto (plan/ sits above runtime/).
- `RemoteState` (`remote`): every segment's state on the memory node (tierlm.node) but the
  `--resident` ones, which stay on the device.

Under any policy, `--remote REGEX` (`place`'s `remote`) moves the matching segments' state to
the memory node: remote host-tier state (`SegmentPlacement.remote`), resident where the policy
made them resident.

A placement that cannot fit its budgets is refused before training with the numbers. The
per-segment record (`SegmentPlacement`) and the chunking constants are mechanism, in
tierlm.memory.placement.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    PlacementError,
    PlacementReport,
    SegmentPlacement,
    gib,
    update_staging_bytes,
)
from tierlm.memory.tiers import Tier
from tierlm.runtime.cache import window_bytes
from tierlm.runtime.schedule import grad_landing, transient_grad
from tierlm.runtime.state import load_bytes, persistent_bytes

# (numels, placements, activation_bytes) -> the bytes per tier (`_account` with the run's sizes)
Account = Callable[..., PlacementReport]
Options = TypeVar("Options")  # the engine's options (tierlm.runtime.plan imports this module)


def landing_staging_bytes(numels: list[int], placements: list[SegmentPlacement],
                          chunk_numel: int) -> int:
    """Host staging a step's gradient landings hold at their peak
    (tierlm.runtime.schedule.grad_landing): the step's landing ring, held from its first landing
    to the sweep's end (tierlm.runtime.landing), the largest any landing of a segment off the
    device adds through; and beside it the largest staging one landing takes for itself (a
    file pass's chunk sets). 0 where every gradient accumulates in place on the device."""
    paths = [(n, grad_landing(p.state_tier, p.gradient_tier, written=written, final=final))
             for n, p in zip(numels, placements, strict=True) if p.state_tier != Tier.DEVICE
             for written in (False, True) for final in (False, True)]
    ring = max((path.ring_numel(n, chunk_numel) for n, path in paths), default=0)
    own = max((path.host_staging_numel(n, chunk_numel) for n, path in paths), default=0)
    return GRAD_B * (ring + own)


def _account(
    numels: list[int], placements: list[SegmentPlacement], activation_bytes: int = 0, *,
    copy_bytes: list[int | None] | None = None, slot_bytes: list[int] | None = None,
    base_copy: bool = False, whole_update: bool = False, frozen: bool = False,
    chunk_numel: int = STAGING_CHUNK_NUMEL, spare: bool = False,
) -> PlacementReport:
    """The bytes each tier holds under `placements`, by the engine's own rules: per segment
    what `init_state` and the compute copies allocate for the run
    (tierlm.runtime.state.persistent_bytes); on the device besides, `activation_bytes`, the
    stream cache's slots (tierlm.runtime.cache.window_bytes) and the gradient an action
    accumulates there before it lands on the state's tier (`transient_grad`,
    tierlm.runtime.schedule), twice: the one before is still landing; in host RAM besides, the
    staging of one disk-tier update and one streamed read of a disk-tier segment
    (`update_staging_bytes`, `load_bytes`), each the largest of any disk segment, since one
    segment's update overlaps another's load, and of the gradient landings
    (`landing_staging_bytes`: the step's landing ring and the largest landing's own staging).

    `copy_bytes`: per segment, its compute copy off the device (None: the fp32 master serves);
    `slot_bytes`: per segment, its optimizer's state (None: none); `frozen`: the weights are
    never updated (a LoRA run's base: no gradient, no slots, no update); `base_copy`: a frozen
    base held in its copy where it has one (bf16 or NF4, tierlm.runtime.frozen), no master;
    `spare`: speculative updates, whose disk-tier segments hold a second set of files."""
    copies = copy_bytes or [None] * len(numels)
    slots = slot_bytes or [0] * len(numels)
    held = {Tier.DEVICE: activation_bytes, Tier.HOST: 0, Tier.DISK: 0, Tier.REMOTE: 0}
    for n, c, b, p in zip(numels, copies, slots, placements, strict=True):
        for tier, _, nbytes in persistent_bytes(p, n, b, c, frozen=frozen,
                                                base_copy=base_copy and c is not None,
                                                spare=spare):
            held[tier] += nbytes
    loads = [load_bytes(p.state_tier, n, c, chunk_numel)
             for n, c, p in zip(numels, copies, placements, strict=True)]
    held[Tier.DEVICE] += window_bytes(
        ld.h2d_bytes for ld, p in zip(loads, placements, strict=True) if not p.resident)
    # an action's gradient, and the one before it still landing beside it (the engine's
    # landing worker has one landing in flight while the next action computes)
    held[Tier.DEVICE] += sum(sorted((GRAD_B * n for n, p in zip(numels, placements, strict=True)
                                     if transient_grad(p.state_tier, frozen)), reverse=True)[:2])
    on_disk = [s for s, p in enumerate(placements) if p.state_tier == Tier.DISK]
    held[Tier.HOST] += max((0 if frozen else update_staging_bytes(
        numels[s], MASTER_B * numels[s] + slots[s]
        + (0 if placements[s].host_grad else GRAD_B * numels[s]),
        copies[s], whole=whole_update, chunk_numel=chunk_numel) for s in on_disk), default=0)
    held[Tier.HOST] += max((loads[s].staging_bytes for s in on_disk), default=0)
    # and the landings on their way to host RAM or their files (the ring held), alongside both
    held[Tier.HOST] += 0 if frozen else landing_staging_bytes(numels, placements, chunk_numel)
    return PlacementReport(placements, held[Tier.DEVICE], held[Tier.HOST], held[Tier.DISK],
                           remote_bytes=held[Tier.REMOTE])


class PlacementPolicy:
    """How `place` chooses a placement per segment when none is given: one subclass per
    `--offload-policy`, found by name in `PLACEMENT_POLICIES` (the planner's `auto` is
    tierlm.plan.policy.Auto, which carries its plan)."""

    name: ClassVar[str]
    """The `--offload-policy` value, as the errors name it."""
    hint: ClassVar[str]
    """What to change when the placement does not fit its budgets."""

    def choose(self, names: list[str], numels: list[int], pinned: Callable[[str], bool], *,
               device_budget_bytes: int | None, host_budget_bytes: int | None,
               activation_bytes: int, account: Account) -> list[SegmentPlacement]:
        raise NotImplementedError

    def engine_options(self, options: Options) -> Options:
        """`options` (the engine's, tierlm.runtime.plan.EngineOptions) placing by this policy;
        a policy that chose more than the placement (the planner's) sets that too."""
        return dataclasses.replace(options, policy=self)


@dataclass(frozen=True)
class AllDevice(PlacementPolicy):
    """`none`: everything on the device (the reference layout, through the runtime)."""

    name: ClassVar[str] = "none"
    hint: ClassVar[str] = "use --offload-policy tiered, host or disk"

    def choose(self, names, numels, pinned, **_) -> list[SegmentPlacement]:
        return [SegmentPlacement(True, Tier.DEVICE) for _ in names]


@dataclass(frozen=True)
class HostState(PlacementPolicy):
    """`host`: state in host RAM; compute weights streamed to the device, except `--resident`
    ones."""

    name: ClassVar[str] = "host"
    hint: ClassVar[str] = "raise the budget, or use --offload-policy disk or tiered"
    tier: ClassVar[Tier] = Tier.HOST

    def choose(self, names, numels, pinned, **_) -> list[SegmentPlacement]:
        return [SegmentPlacement(pinned(n), self.tier) for n in names]


@dataclass(frozen=True)
class DiskState(HostState):
    """`disk`: state in files under `--offload-dir`; weights streamed from there."""

    name: ClassVar[str] = "disk"
    hint: ClassVar[str] = "raise the budget, or pin fewer segments with --resident"
    tier: ClassVar[Tier] = Tier.DISK


@dataclass(frozen=True)
class Tiered(PlacementPolicy):
    """`tiered`: fill the device (embed, head, then blocks from the last one backwards, as
    their backward comes soonest), then host RAM, then disk."""

    name: ClassVar[str] = "tiered"
    hint: ClassVar[str] = "raise --device-budget/--host-budget or give more disk"

    def choose(self, names, numels, pinned, *, device_budget_bytes, host_budget_bytes,
               activation_bytes, account) -> list[SegmentPlacement]:
        return _tiered(names, numels, pinned, device_budget_bytes, host_budget_bytes,
                       activation_bytes, account)


@dataclass(frozen=True)
class Planned(PlacementPolicy):
    """`auto`: placements chosen elsewhere (the planner's, given to `place` as `placements`),
    which `place` only accounts and checks; it chooses none itself."""

    name: ClassVar[str] = "auto"
    hint: ClassVar[str] = "raise the budgets, or see `tierlm plan` for what would fit"

    def choose(self, names, numels, pinned, **_) -> list[SegmentPlacement]:
        raise PlacementError("--offload-policy auto: the planner's placements are missing "
                             "(tierlm.plan.policy.Auto gives them)")


@dataclass(frozen=True)
class RemoteState(PlacementPolicy):
    """`remote`: every segment's master and optimizer state on the memory node (host RAM
    holds its landed gradient and the compute copy the stream uploads from), but the
    `--resident` ones, which keep their state on the device."""

    name: ClassVar[str] = "remote"
    hint: ClassVar[str] = ("give the memory node more --memory, or put fewer segments on it "
                           "with --offload-policy host/tiered and --remote REGEX")

    def choose(self, names, numels, pinned, **_) -> list[SegmentPlacement]:
        return [SegmentPlacement(True, Tier.DEVICE) if pinned(n)
                else SegmentPlacement(False, Tier.HOST, remote=True) for n in names]


# --offload-policy name -> its policy
PLACEMENT_POLICIES: dict[str, PlacementPolicy] = {
    p.name: p for p in (AllDevice(), HostState(), DiskState(), Tiered(), Planned(),
                        RemoteState())
}


def to_remote(placements: list[SegmentPlacement], names: list[str], pattern: str | None
              ) -> list[SegmentPlacement]:
    """`placements` with the segments `pattern` matches (--remote, a regex over the whole
    name) moved to the memory node, resident where they were (a device-tier segment was)."""
    if not pattern:
        return placements
    match = re.compile(pattern)
    return [SegmentPlacement(p.resident, Tier.HOST, remote=True) if match.fullmatch(n) else p
            for n, p in zip(names, placements, strict=True)]


def placement_policy(policy: str | PlacementPolicy) -> PlacementPolicy:
    """The policy `policy` names (`--offload-policy`), or `policy` itself."""
    if isinstance(policy, PlacementPolicy):
        return policy
    try:
        return PLACEMENT_POLICIES[policy]
    except KeyError:
        raise PlacementError(f"--offload-policy {policy}: unknown policy") from None


def place(
    names: list[str],
    numels: list[int],
    *,
    policy: str | PlacementPolicy,
    resident: str | None = None,
    device_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    disk_budget_bytes: int | None = None,
    activation_bytes: int = 0,
    placements: list[SegmentPlacement] | None = None,
    copy_bytes: list[int | None] | None = None,
    slot_bytes: list[int] | None = None,
    base_copy: bool = False,
    whole_update: bool = False,
    frozen: bool = False,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
    remote: str | None = None,
    spare: bool = False,
) -> PlacementReport:
    """Choose a placement per segment by `policy` (a PlacementPolicy or its name) and check it
    against the budgets; `remote` (--remote): a regex of segments whose state then moves to
    the memory node (`to_remote`).

    `activation_bytes`: device bytes the step holds in boundary activations and their gradients,
    reserved before any weights are placed. `placements`: a placement chosen elsewhere (the
    planner); it is only accounted and checked. `copy_bytes`: each segment's compute copy where
    a precision policy gives it one (None: it streams its fp32 master); `slot_bytes`: each
    segment's optimizer state (None: none); `whole_update`: the optimizer updates whole
    segments (align 0), so a disk segment's update stages all of its state at once;
    `frozen`: the segments are frozen weights (a LoRA run's base: no gradient, no slots, no
    update), whose trained adapters' device bytes come in `activation_bytes`; `base_copy`: the
    frozen base is held in its copy alone where it has one; `chunk_numel`: the engine's staging
    chunk; `spare`: speculative updates' second set of disk-tier files. `_account` says how
    these become bytes per tier. Every budget given is checked,
    whichever the policy (`disk_budget_bytes`: --disk-budget, what the disk tier may hold).
    """
    rule = placement_policy(policy)
    account = functools.partial(_account, copy_bytes=copy_bytes, slot_bytes=slot_bytes,
                                base_copy=base_copy, whole_update=whole_update, frozen=frozen,
                                chunk_numel=chunk_numel, spare=spare)
    if placements is None:
        pattern = re.compile(resident) if resident else None

        def pinned(name: str) -> bool:
            return bool(pattern and pattern.fullmatch(name))

        placements = rule.choose(names, numels, pinned, device_budget_bytes=device_budget_bytes,
                                 host_budget_bytes=host_budget_bytes,
                                 activation_bytes=activation_bytes, account=account)
        placements = to_remote(placements, names, remote)
    report = account(numels, placements, activation_bytes)
    _check(report, device_budget_bytes, host_budget_bytes, rule, disk_budget_bytes)
    return report


def _tiered(
    names, numels, pinned, device_budget, host_budget, activation_bytes, account=_account
) -> list[SegmentPlacement]:
    # Order of preference for the device: segments the user pinned, then embed and head (their
    # reload is the costliest per use), then blocks from the last one back (backward reaches
    # them first, so they are needed again soonest).
    order = sorted(
        range(len(names)),
        key=lambda i: (
            not pinned(names[i]),
            names[i] not in ("embed", "head"),
            -i,
        ),
    )
    placements = [SegmentPlacement(False, Tier.HOST) for _ in names]
    if device_budget is not None:
        for i in order:
            trial = list(placements)
            trial[i] = SegmentPlacement(True, Tier.DEVICE)
            if account(numels, trial, activation_bytes).device_bytes <= device_budget:
                placements = trial
    else:
        placements = [SegmentPlacement(True, Tier.DEVICE) for _ in names]
    if host_budget is not None:
        # Spill host-state segments to disk, earliest blocks first, until the host fits.
        for i in range(len(names)):
            if account(numels, placements).host_bytes <= host_budget:
                break
            if placements[i].state_tier == Tier.HOST:
                placements[i] = SegmentPlacement(False, Tier.DISK)
    return placements


def _check(report: PlacementReport, device_budget, host_budget,
           policy: PlacementPolicy, disk_budget=None) -> None:
    problems = []
    if device_budget is not None and report.device_bytes > device_budget:
        problems.append(
            f"device needs {gib(report.device_bytes)} of model state but --device-budget is "
            f"{gib(device_budget)}"
        )
    if host_budget is not None and report.host_bytes > host_budget:
        problems.append(
            f"host needs {gib(report.host_bytes)} but --host-budget is {gib(host_budget)}"
        )
    if disk_budget is not None and report.disk_bytes > disk_budget:
        problems.append(
            f"the disk tier needs {gib(report.disk_bytes)} but --disk-budget is "
            f"{gib(disk_budget)}"
        )
    if problems:
        raise PlacementError(f"placement --offload-policy {policy.name} does not fit: "
                             + "; ".join(problems) + f" ({policy.hint})")

"""Placement policy and its accounting: the bytes each tier holds under a placement, by the
engine's own rules (tierlm.runtime.state.persistent_bytes, the stream cache's window, the
gradient landings), and `place`, which chooses placements from `--offload-policy` and the
budgets:

- `none`: everything on the device (the reference layout, through the runtime).
- `host`: state in host RAM; compute weights streamed to the device, except `--resident` ones.
- `disk`: state in files under `--offload-dir`; weights streamed from there.
- `tiered`: fill the device (embed, head, then blocks from the last one backwards, as their
  backward comes soonest), then host RAM, then disk.

A placement that cannot fit its budgets is refused before training with the numbers. The
per-segment record (`SegmentPlacement`) and the chunking constants are mechanism, in
tierlm.memory.placement.
"""

from __future__ import annotations

import functools
import re

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
    chunk_numel: int = STAGING_CHUNK_NUMEL,
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
    base held in its copy where it has one (bf16 or NF4, tierlm.runtime.frozen), no master."""
    copies = copy_bytes or [None] * len(numels)
    slots = slot_bytes or [0] * len(numels)
    held = {Tier.DEVICE: activation_bytes, Tier.HOST: 0, Tier.DISK: 0}
    for n, c, b, p in zip(numels, copies, slots, placements, strict=True):
        for tier, _, nbytes in persistent_bytes(p, n, b, c, frozen=frozen,
                                                base_copy=base_copy and c is not None):
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
    return PlacementReport(placements, held[Tier.DEVICE], held[Tier.HOST], held[Tier.DISK])


def place(
    names: list[str],
    numels: list[int],
    *,
    policy: str,
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
) -> PlacementReport:
    """Choose a placement per segment and check it against the budgets.

    `activation_bytes`: device bytes the step holds in boundary activations and their gradients,
    reserved before any weights are placed. `placements`: a placement chosen elsewhere (the
    planner); it is only accounted and checked. `copy_bytes`: each segment's compute copy where
    a precision policy gives it one (None: it streams its fp32 master); `slot_bytes`: each
    segment's optimizer state (None: none); `whole_update`: the optimizer updates whole
    segments (align 0), so a disk segment's update stages all of its state at once;
    `frozen`: the segments are frozen weights (a LoRA run's base: no gradient, no slots, no
    update), whose trained adapters' device bytes come in `activation_bytes`; `base_copy`: the
    frozen base is held in its copy alone where it has one; `chunk_numel`: the engine's staging
    chunk. `_account` says how these become bytes per tier. Every budget given is checked,
    whichever the policy (`disk_budget_bytes`: --disk-budget, what the disk tier may hold).
    """
    account = functools.partial(_account, copy_bytes=copy_bytes, slot_bytes=slot_bytes,
                                base_copy=base_copy, whole_update=whole_update, frozen=frozen,
                                chunk_numel=chunk_numel)
    if placements is not None:
        report = account(numels, placements, activation_bytes)
        _check(report, device_budget_bytes, host_budget_bytes, policy, disk_budget_bytes)
        return report
    pattern = re.compile(resident) if resident else None

    def pinned(name: str) -> bool:
        return bool(pattern and pattern.fullmatch(name))

    if policy == "none":
        placements = [SegmentPlacement(True, Tier.DEVICE) for _ in names]
    elif policy in ("host", "disk"):
        tier = Tier.HOST if policy == "host" else Tier.DISK
        placements = [SegmentPlacement(pinned(n), tier) for n in names]
    elif policy == "tiered":
        placements = _tiered(
            names, numels, pinned, device_budget_bytes, host_budget_bytes, activation_bytes,
            account,
        )
    else:
        raise PlacementError(f"--offload-policy {policy}: unknown policy")
    report = account(numels, placements, activation_bytes)
    _check(report, device_budget_bytes, host_budget_bytes, policy, disk_budget_bytes)
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


def _check(report: PlacementReport, device_budget, host_budget, policy,
           disk_budget=None) -> None:
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
        hint = {
            "none": "use --offload-policy tiered, host or disk",
            "host": "raise the budget, or use --offload-policy disk or tiered",
            "disk": "raise the budget, or pin fewer segments with --resident",
            "tiered": "raise --device-budget/--host-budget or give more disk",
            "auto": "raise the budgets, or see `tierlm plan` for what would fit",
        }[policy]
        raise PlacementError(f"placement --offload-policy {policy} does not fit: "
                             + "; ".join(problems) + f" ({hint})")

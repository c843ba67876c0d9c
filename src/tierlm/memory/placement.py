"""Placement: which segments keep compute weights on the device, and which tier holds each
segment's master weights, gradient and optimizer state.

Until the planner exists, placement follows `--offload-policy` and the budgets:

- `none`: everything on the device (the reference layout, through the runtime).
- `host`: state in host RAM; compute weights streamed to the device, except `--resident` ones.
- `disk`: state in files under `--offload-dir`; weights streamed from there.
- `tiered`: fill the device (embed, head, then blocks from the last one backwards, as their
  backward comes soonest), then host RAM, then disk.

A placement that cannot fit its budgets is refused before training with the numbers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from tierlm.memory.arena import PinnedBytes
from tierlm.memory.tiers import Tier

# Bytes per parameter of fp32 compute weights, master weights and gradients. With
# --precision bf16/fp8 a segment whose state is off the device also holds a compute copy
# (tierlm.precision.streaming: ~2 or ~1 bytes per parameter), in host RAM or on disk, which is
# what streams; `place` is given each segment's copy bytes. What each tier holds is the engine's
# own rule (tierlm.runtime.state.persistent_bytes), which `_account` sums.
COMPUTE_B = 4
MASTER_B = GRAD_B = 4
# Disk-tier state moves through host staging in chunks of this many fp32 elements per copy
# (64 MiB), so host RAM holds a few chunks, never a whole segment (a 152k-token embedding is
# 233M parameters). A multiple of 1024 elements: chunk offsets are O_DIRECT-aligned.
STAGING_CHUNK_NUMEL = 16 << 20
STAGING_SETS = 2  # chunk buffers per copy: the one in use and the next one being read


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """(first element, length) of each chunk of a segment's flat state."""
    return [(lo, min(chunk_numel, numel - lo)) for lo in range(0, numel, chunk_numel)] or [(0, 0)]


def staging_numel(numel: int, chunk_numel: int = STAGING_CHUNK_NUMEL) -> int:
    """Host staging elements per copy while a segment's copy streams through in chunks."""
    return min(numel, chunk_numel) * min(STAGING_SETS, len(chunk_ranges(numel, chunk_numel)))


class PlacementError(ValueError):
    """The requested placement does not fit a budget; the message has the numbers."""


@dataclass(frozen=True)
class SegmentPlacement:
    resident: bool  # compute weights stay on the device between uses
    state_tier: Tier  # master weights, gradient and optimizer state
    grad_tier: Tier | None = None
    """Where the gradient accumulates between the backward and the update; None: with the
    state. Only disk-tier state may hold its gradient on the host (no gradient byte then
    touches the disk: the update reads master and slots from disk, the gradient from RAM)."""

    def __post_init__(self) -> None:
        if self.grad_tier not in (None, self.state_tier) and not (
                self.state_tier == Tier.DISK and self.grad_tier == Tier.HOST):
            raise ValueError(f"a segment with {self.state_tier.value}-tier state cannot hold its "
                             f"gradient on the {self.grad_tier.value} tier (only disk state "
                             "may keep its gradient on the host)")

    @property
    def gradient_tier(self) -> Tier:
        """The tier the gradient lives on (the state's unless `grad_tier` says otherwise)."""
        return self.grad_tier or self.state_tier

    @property
    def host_grad(self) -> bool:
        """Disk-tier state whose gradient waits in host RAM."""
        return self.state_tier == Tier.DISK and self.gradient_tier == Tier.HOST


def gib(nbytes: float) -> str:
    """Human-readable bytes (GiB, MiB or KiB, whichever reads best)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


@dataclass(frozen=True)
class PlacementReport:
    placements: list[SegmentPlacement]
    device_bytes: int  # predicted managed peak: weights, grads, state, boundary activations
    host_bytes: int
    disk_bytes: int
    # of the host bytes, what the run pins for PCIe copies (its pinned arena, sized by
    # tierlm.runtime.pinned; plan_step fills it in); None: not known yet
    pinned: PinnedBytes | None = None


def update_staging_bytes(
    numel: int, staged_bytes: int, copy_bytes: int | None, *, whole: bool,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
) -> int:
    """Host staging of one disk-tier update of a segment of `numel` parameters that stages
    `staged_bytes` of its state (master, optimizer slots, and the gradient unless it waits in
    RAM): every copy's part of a chunk, for the chunks in flight; or all of it where the update
    takes whole segments (`whole`: an optimizer with align 0) or encodes a compute copy
    (`copy_bytes`, None: the segment has none; fp8 scales need whole tensors), whose bytes it
    stages besides. Slots are taken to scale with the chunk's share of the segment (exact for
    elementwise slots; chunks cut at parameter starts are at most `chunk_numel` long)."""
    if copy_bytes is not None:
        return staged_bytes + copy_bytes
    if whole or numel <= chunk_numel:
        return staged_bytes
    return -(-staged_bytes * staging_numel(numel, chunk_numel) // numel)


def landing_staging_bytes(numels: list[int], placements: list[SegmentPlacement],
                          chunk_numel: int) -> int:
    """Host staging a step's gradient landings hold at their peak
    (tierlm.runtime.schedule.grad_landing): the step's landing ring, held from its first landing
    to the sweep's end (tierlm.runtime.landing), the largest any landing of a segment off the
    device adds through; and beside it the largest staging one landing takes for itself (a
    file pass's chunk sets). 0 where every gradient accumulates in place on the device."""
    from tierlm.runtime.schedule import grad_landing

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
    base held in its copy where it has one (bf16 or NF4, tierlm.models.frozen), no master."""
    # the engine's rules; runtime.state imports this module, so they are imported here
    from tierlm.runtime.cache import window_bytes
    from tierlm.runtime.schedule import transient_grad
    from tierlm.runtime.state import load_bytes, persistent_bytes

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


KeepGraphs = bool | tuple[bool, ...]
"""The planner's rule (a bool) or a keep flag per segment: see `keeps_graph`."""


def keeps_graph(placements, keep: KeepGraphs) -> list[bool]:
    """Per segment, whether its backward runs from a kept graph (no recompute of its forward).
    `keep` is the planner's rule, a bool (resident segments keep their graph when True,
    streamed ones recompute), or the engine's own choice per segment (`--grad-checkpointing
    none` keeps streamed graphs where the device budget holds them: tierlm.activations.spec),
    the head's entry last."""
    if isinstance(keep, bool):
        return [p.resident and keep for p in placements]
    if len(keep) != len(placements):
        raise ValueError(f"{len(keep)} keep flags for {len(placements)} segments")
    return list(keep)

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

from tierlm.memory.tiers import Tier

# Bytes per parameter of fp32 compute weights. With --precision bf16/fp8 a segment whose state
# is off the device holds its compute copy instead (tierlm.precision.streaming: ~2 or ~1 bytes
# per parameter), on the device, in host RAM or on disk, and `place` is given each segment's
# compute-copy bytes. A segment's state bytes (fp32 master, which is also the compute copy on the
# device tier, fp32 gradient, and the optimizer's slots) are given per segment: `state_bytes`.
COMPUTE_B = 4
MASTER_B = GRAD_B = 4
STREAM_SLOTS = 2  # the segment running and the one being prefetched
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


def _stream_bytes(
    numels: list[int], compute: list[int], placements: list[SegmentPlacement],
    frozen: bool = False,
) -> int:
    """Device bytes the streaming window needs: compute copies for the slots and one gradient
    (fp32; none for frozen weights)."""
    streamed = [(c, n) for n, c, p in zip(numels, compute, placements, strict=True)
                if not p.resident]
    if not streamed:
        return 0
    slots = sorted((c for c, _ in streamed), reverse=True)[:STREAM_SLOTS]
    return sum(slots) + (0 if frozen else max(n for _, n in streamed) * GRAD_B)


def update_staging_bytes(
    numel: int, state_bytes: int, *, whole: bool, chunk_numel: int = STAGING_CHUNK_NUMEL
) -> int:
    """Host staging of one disk-tier update of a segment of `numel` parameters whose state
    (master, gradient, optimizer slots) is `state_bytes`: every copy's part of a chunk, for the
    chunks in flight, or the whole state where the update takes whole segments (`whole`: an
    optimizer with align 0, or a compute copy to encode). Slots are taken to scale with the
    chunk's share of the segment (exact for elementwise slots; chunks cut at parameter starts
    are at most `chunk_numel` long)."""
    if whole or numel <= chunk_numel:
        return state_bytes
    return -(-state_bytes * staging_numel(numel, chunk_numel) // numel)


def _account(
    numels: list[int], placements: list[SegmentPlacement], activation_bytes: int = 0,
    compute_bytes: list[int] | None = None, state_bytes: list[int] | None = None,
    whole_update: bool = False, frozen: bool = False,
) -> PlacementReport:
    """`compute_bytes`: per segment, the bytes of its compute copy (None: fp32, COMPUTE_B per
    parameter); a copy smaller than fp32 is kept besides the master, in host RAM or on disk.
    `state_bytes`: per segment, master + gradient + optimizer state (`place`). `frozen`: the
    weights are never updated (a LoRA run's base): no gradient, no update staging, and the
    state is what streams (a QLoRA base's NF4 bytes: its `state_bytes` are its compute copy's)."""
    compute = compute_bytes or [n * COMPUTE_B for n in numels]
    state = state_bytes or [n * (MASTER_B + (0 if frozen else GRAD_B)) for n in numels]
    device, host, disk = activation_bytes, 0, 0
    for n, c, b, p in zip(numels, compute, state, placements, strict=True):
        # fp32 streams the master itself, a frozen base its state (NF4 under --finetune qlora)
        own_copy = c if c != n * COMPUTE_B and not frozen else 0
        if p.state_tier == Tier.DEVICE:
            device += b
        elif p.state_tier == Tier.HOST:
            host += b + own_copy
            device += c if p.resident else 0
        else:
            grad = 0 if frozen else GRAD_B * n
            if p.host_grad:  # the gradient waits in RAM, not in a file
                host, disk = host + grad, disk - grad
            disk += b + own_copy  # the gradient has a file too, unless held on the host
            device += c if p.resident else 0
    device += _stream_bytes(numels, compute, placements, frozen)
    on_disk = [(n, c, b) for n, c, b, p in zip(numels, compute, state, placements, strict=True)
               if p.state_tier == Tier.DISK]
    if on_disk:
        # staging for one update and one streamed read: chunk by chunk in fp32, whole where the
        # segment has a compute copy (its fp8 scales need whole tensors)
        host += max(
            (0 if frozen else update_staging_bytes(n, b, whole=whole_update))
            + staging_numel(n) * COMPUTE_B if c == n * COMPUTE_B else (0 if frozen else b) + c
            for n, c, b in on_disk)
    return PlacementReport(placements, device, host, disk)


def place(
    names: list[str],
    numels: list[int],
    *,
    policy: str,
    resident: str | None = None,
    device_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    activation_bytes: int = 0,
    placements: list[SegmentPlacement] | None = None,
    compute_bytes: list[int] | None = None,
    state_bytes: list[int] | None = None,
    whole_update: bool = False,
    frozen: bool = False,
) -> PlacementReport:
    """Choose a placement per segment and check it against the budgets.

    `activation_bytes`: device bytes the step holds in boundary activations and their gradients,
    reserved before any weights are placed. `placements`: a placement chosen elsewhere (the
    planner); it is only accounted and checked. `compute_bytes`: each segment's compute-copy
    bytes where a precision policy shrinks them (see `_account`). `state_bytes`: each segment's
    master, gradient and optimizer-state bytes (None: master and gradient only);
    `whole_update`: the optimizer updates whole segments (align 0), so a disk segment's update
    stages all of its state at once; `frozen`: the segments are frozen weights (a LoRA run's
    base: master bytes only, `state_bytes` says so; no gradient in the streaming window, no
    update staging), whose trained adapters' device bytes come in `activation_bytes`.
    """
    account = functools.partial(_account, compute_bytes=compute_bytes, state_bytes=state_bytes,
                                whole_update=whole_update, frozen=frozen)
    if placements is not None:
        report = account(numels, placements, activation_bytes)
        _check(report, device_budget_bytes, host_budget_bytes, policy)
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
    _check(report, device_budget_bytes, host_budget_bytes, policy)
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


def _check(report: PlacementReport, device_budget, host_budget, policy) -> None:
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

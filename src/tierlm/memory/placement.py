"""Placement mechanism: the per-segment record of which tier holds a segment's compute weights,
master weights, gradient and optimizer state (`SegmentPlacement`), the bytes per parameter, the
disk-tier chunking and staging sizes, and the report a placement's accounting fills
(`PlacementReport`). Choosing placements and accounting for them by the engine's rules is
tierlm.runtime.placement (`place`); the planner's search is tierlm.plan."""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.memory.arena import PinnedBytes
from tierlm.memory.tiers import Tier

# Bytes per parameter of fp32 compute weights, master weights and gradients. With
# --precision bf16/fp8 a segment whose state is off the device also holds a compute copy
# (tierlm.precision.streaming: ~2 or ~1 bytes per parameter), in host RAM or on disk, which is
# what streams; `place` is given each segment's copy bytes. What each tier holds is the engine's
# own rule (tierlm.runtime.state.persistent_bytes), which tierlm.runtime.placement sums.
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
    remote: bool = False
    """Host-tier state whose fp32 master and optimizer slots live on a memory node
    (tierlm.node, `Tier.REMOTE`): host RAM keeps the landed gradient and the compute copy the
    stream uploads from (the fp32 weights where the segment has no compute copy), refreshed
    from the node after each update. Every host-tier path of the step (loads, landing, norms)
    is the same; the update, the first fill and the checkpoint go over the network."""

    def __post_init__(self) -> None:
        if self.remote and (self.state_tier != Tier.HOST or self.grad_tier is not None):
            raise ValueError("remote state is host-tier state whose master and slots live on "
                             "the memory node (state_tier host, gradient with it)")
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
    def home(self) -> Tier:
        """Where the master and optimizer state live: the state's tier, or the memory node."""
        return Tier.REMOTE if self.remote else self.state_tier

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
    # bytes the memory node holds for the run (tierlm.node: master, slots, its gradient sum and
    # compute copy per remote segment); 0 without remote segments
    remote_bytes: int = 0


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

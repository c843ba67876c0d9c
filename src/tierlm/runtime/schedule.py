"""The step's schedule and the rules its actions follow, as pure functions (issue J: one byte
model).

The engine (tierlm.runtime.engine) executes these rules on tensors; the planner's replay
(tierlm.runtime.byte_replay._simulate) runs the same functions over byte counts. A change to the
schedule, to which segments an action reads, to where a gradient goes or to which boundary
inputs wait on the host therefore changes the plan with it. The read-ahead rule lives beside
them in tierlm.runtime.readahead.

Nothing here touches a tensor or a store: the arguments are segment indices, tiers and counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from tierlm.memory.placement import staging_numel
from tierlm.memory.tiers import Link, Tier

ORDERS = ("microbatch-outer", "layer-outer")

T = TypeVar("T")


@dataclass(frozen=True)
class Action:
    kind: str  # "fwd" | "head" | "bwd"
    seg: int
    mbs: tuple[int, ...]

    def label(self, names: list[str]) -> str:
        return f"{self.kind} {names[self.seg]} mb{','.join(map(str, self.mbs))}"


# -- the schedule ---------------------------------------------------------------------------------


def micro_batches_in_flight(m: int, order: str) -> int:
    """Micro-batches whose activations the step holds at once: all of them layer-outer."""
    return m if order == "layer-outer" else 1


def microbatch_groups(m: int, order: str) -> list[tuple[int, ...]]:
    """The micro-batches each sweep runs together, in order."""
    if order not in ORDERS:
        raise ValueError(f"microbatch order must be one of {ORDERS}, got {order!r}")
    return [tuple(range(m))] if order == "layer-outer" else [(i,) for i in range(m)]


def runs_backward(s: int, first_trained: bool) -> bool:
    """Whether segment `s` has a backward: every segment but an untrained first one (a LoRA
    run's embedding: nothing before it takes a gradient)."""
    return s > 0 or first_trained


def step_schedule(n_segs: int, m: int, order: str, *, first_trained: bool = True
                  ) -> list[Action]:
    """One optimizer step over `m` micro-batches of an `n_segs`-segment model (the last one the
    head): per group of micro-batches, the forward sweep, the head, the backward sweep."""
    last = n_segs - 1
    actions = []
    for mbs in microbatch_groups(m, order):
        actions += [Action("fwd", s, mbs) for s in range(last)]
        actions.append(Action("head", last, mbs))
        actions += [Action("bwd", s, mbs) for s in reversed(range(last))
                    if runs_backward(s, first_trained)]
    return actions


def reads(a: Action, tied_owners: Sequence[int] = ()) -> list[int]:
    """Segments whose device copy action `a` reads: its own, and for the head the owners of the
    weights it borrows (tied embeddings), one entry per borrowed tensor."""
    return [a.seg, *tied_owners] if a.kind == "head" else [a.seg]


def streamed_reads(a: Action, resident: Sequence[bool], tied_owners: Sequence[int] = ()
                   ) -> list[int]:
    """The segments of `reads` that stream (the stream cache's access sequence): a resident
    segment's copy, and so any graph it keeps, is on the device throughout."""
    return [s for s in reads(a, tied_owners) if not resident[s]]


# -- boundary activations -------------------------------------------------------------------------


def parked_inputs(policies: Sequence[str], on_host: bool) -> frozenset[int]:
    """Segments (before the head: one policy each) whose boundary input waits on the host
    between their forward and their backward: with host boundaries, those that recompute from
    it (`full`); a kept graph pins its input on the device. Segment 0's input is the token ids,
    never held."""
    if not on_host:
        return frozenset()
    return frozenset(s for s, name in enumerate(policies) if s > 0 and name == "full")


def boundary_activation_bytes(
    n_segs: int, hidden_bytes: int, m: int, order: str, *, on_host: bool = False
) -> int:
    """Peak device bytes of boundary activations and their gradients the step holds: the
    input of every segment after `embed` for the micro-batches in flight, plus two
    gradients; with the inputs parked on the host, one segment's inputs and outputs (or, in
    the backward, its output gradients, the input brought back, the next one on its way back
    (tierlm.runtime.walk) and one new gradient)."""
    n = micro_batches_in_flight(m, order)
    if on_host:
        return (n + max(n, 3)) * hidden_bytes
    return n * (n_segs - 1 + 2) * hidden_bytes


# -- gradients ------------------------------------------------------------------------------------


def transient_grad(state_tier: Tier, frozen: bool) -> bool:
    """Whether an action's gradient of a segment accumulates in a device buffer of its own, freed
    once it has landed: for trained weights whose state is off the device. Device state
    accumulates in its persistent gradient; a frozen base's adapters are device state."""
    return state_tier != Tier.DEVICE and not frozen


def grad_from_head(s: int, tied_trained: bool, state_tier: Tier) -> bool:
    """The owner of tied weights whose state is off the device needs no gradient buffer of
    its own for a backward action: the buffer the head's contribution and its own first
    micro-batch's are summed in takes that place, and the later micro-batches join it."""
    return s == 0 and tied_trained and state_tier != Tier.DEVICE


@dataclass(frozen=True)
class FilePass:
    """One chunked pass between the device gradient and its file: `add`: the file's partial sum
    is read and the device's added to it (else the device's alone); `back`: the sum returns to
    the device buffer (else it is written to the file)."""

    add: bool
    back: bool


@dataclass(frozen=True)
class GradLanding:
    """Where one action's gradient of a segment goes on its way to the optimizer's tier."""

    to_host: bool = False  # added into the host gradient (host state, or a held disk gradient)
    passes: tuple[FilePass, ...] = ()  # disk: through host staging, in this order
    written: bool = False  # afterwards the file holds a partial sum of this step

    def ring_numel(self, numel: int, chunk_numel: int) -> int:
        """Elements of the step's landing ring (tierlm.runtime.landing.LandingRing) this landing
        of a `numel`-element gradient adds through: the whole gradient's ring into host RAM
        (`to_host`); one chunk's where a file pass adds the device's chunk to the file's; 0
        where nothing is added on the host."""
        if self.to_host:
            return landing_staging_numel(numel, chunk_numel)
        if any(p.add for p in self.passes):
            return landing_staging_numel(min(numel, chunk_numel), chunk_numel)
        return 0

    def host_staging_numel(self, numel: int, chunk_numel: int) -> int:
        """Host staging elements this landing of a `numel`-element gradient takes for itself at
        its peak, besides the step's landing ring (`ring_numel`): each file pass's chunk sets
        (tierlm.runtime.state.stream_chunks)."""
        return staging_numel(numel, chunk_numel) if self.passes else 0

    def moves(self, grad_bytes: int) -> list[tuple[Link, int]]:
        """(link, bytes) of each copy this landing makes, pass by pass; within a pass the
        chunks interleave, listed D2H first (the planner's timeline starts a landing there)."""
        out = [(Link.D2H, grad_bytes)] if self.to_host else []
        for p in self.passes:
            out.append((Link.D2H, grad_bytes))
            if p.add:
                out.append((Link.DISK_READ, grad_bytes))
            out.append((Link.H2D if p.back else Link.DISK_WRITE, grad_bytes))
        return out


def landing_staging_numel(numel: int, chunk_numel: int) -> int:
    """Host staging elements of adding a device gradient of `numel` elements into a host buffer
    (tierlm.runtime.landing): a ring of two chunk buffers, one taking the next chunk's D2H copy
    while the CPU adds the other; one buffer the gradient's size where it is a chunk or less."""
    return staging_numel(numel, chunk_numel)


def grad_landing(state_tier: Tier, gradient_tier: Tier, *, written: bool, final: bool
                 ) -> GradLanding:
    """The path of an action's gradient (`final`: the step's last contribution; `written`: the
    gradient file already holds this step's earlier ones). A disk gradient completes its sum on
    the device on the final contribution (the sync and the norms read it whole there), then is
    written out; earlier contributions sum in the file."""
    if state_tier == Tier.DEVICE:
        return GradLanding()
    if gradient_tier == Tier.HOST:
        return GradLanding(to_host=True)
    if not final:
        return GradLanding(passes=(FilePass(add=written, back=False),), written=True)
    passes = (FilePass(add=True, back=True),) if written else ()
    return GradLanding(passes=(*passes, FilePass(add=False, back=False)))


MOST_HELD_GRADIENTS = 2
"""The most complete gradients the planner has speculative updates keep in host RAM at once
(EngineOptions.held_gradients, `held_before`); it gives them fewer where host RAM has no room."""


def keeps_landed_grad(path: GradLanding, *, final: bool, speculated: bool) -> bool:
    """Whether a landing also leaves its segment's whole gradient in host staging, for the
    speculative update issued behind it (`speculated`: its update is) to take instead of
    reading the gradient file back: the final landing into a gradient file, whose last pass
    carries the complete sum from the device (tierlm.runtime.gradients). The file is still
    written: a redo below coefficient 1 reads it."""
    return speculated and final and not path.to_host and bool(path.passes)


def held_before(kept: Sequence[T], held: int) -> T | None:
    """What a landing that keeps a gradient (`keeps_landed_grad`) waits for before it takes its
    buffer, given the speculations that took the latest ones (`kept`, oldest first) and the
    most gradients kept at once (`held`): the speculation `held` before it, which frees its own
    as it ends (None: fewer are kept). A backward that outruns the update worker so holds no
    more than `held`, however far behind the worker is; the planner's replays wait and count
    the same way."""
    return kept[-held] if len(kept) >= held else None


def final_landing(a: Action, micro_batches: int) -> bool:
    """Whether action `a` lands its segment's last gradient contribution of the step (the
    head's and each backward's land once per action, tierlm.runtime.walk)."""
    return a.mbs[-1] == micro_batches - 1


def landing_ring_numel(actions: Sequence[Action], micro_batches: int,
                       landings: Sequence[tuple[Tier, Tier, int] | None], chunk_numel: int
                       ) -> int:
    """Elements of the landing ring a step of `actions` holds (tierlm.runtime.landing): the
    largest ring any of its landings adds through, landing by landing in the step's order (a
    gradient file holds a partial sum from its segment's second landing on); 0 where none adds
    into host RAM. `landings[s]`: segment s's state tier, gradient tier and element count
    where its gradient lands off the device (`transient_grad`), else None."""
    written = [False] * len(landings)
    most = 0
    for a in actions:
        lands = landings[a.seg]
        if a.kind == "fwd" or lands is None:
            continue
        state_tier, gradient_tier, numel = lands
        path = grad_landing(state_tier, gradient_tier, written=written[a.seg],
                            final=final_landing(a, micro_batches))
        written[a.seg] = path.written
        most = max(most, path.ring_numel(numel, chunk_numel))
    return most

"""One step's walk over its actions, written once (issue J: one byte model).

The schedule (tierlm.runtime.schedule) says which actions a step runs; this module says in what
order each action waits for, holds, parks, drops and lands what it touches. `Engine.step` walks
it over tensors, computing as it goes; the planner's replay (tierlm.runtime.byte_replay._simulate)
walks it over byte counts. What the two do differently sits behind `StepBackend`: the engine's
compute (activation policies, the chunked loss, clocks, trace spans), stores and copies; the
replay's counting store and its marks for the timeline. Change the order here and the plan
changes with the engine.

An action, in order:

- prepare: a backward's gradient buffer, then its weights; a forward's weights; the head's
  weights, its gradient buffer, then the weights it borrows (tied embeddings). The owner of
  tied weights whose state is off the device takes no buffer of its own
  (`schedule.grad_from_head`): the head's buffer for its first micro-batch becomes it;
- forward, per micro-batch: compute, hold the output (the next segment's boundary input), and
  start its copy to the host when that input parks there; once the group has run, the parked
  inputs it read leave the device (their copies are waited for, then they are dropped);
- head, per micro-batch: a buffer the tied weights' gradient collects in, compute, hold the
  gradient at the input, drop the input;
- backward, per micro-batch: its input, if parked, brought back (unless the micro-batch before
  brought it back) and waited for; the next parked input the backward reads starts back (one
  micro-batch ahead: its copy runs under this compute); compute, drop the output's gradient,
  hold the input's (where the segment before has a backward), drop the input; the owner of
  tied weights adopts the head's buffer as its gradient, or adds it into its own and frees it;
  then the host copies of the inputs it brought back are freed;
- land the action's gradient (head and backward; final on the step's last micro-batch);
- start loading the next action's weights, then the read-ahead's reads that follow this action.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from tierlm.memory.tiers import Tier
from tierlm.runtime.schedule import Action, final_landing, grad_from_head, runs_backward

Buf = Any  # a tensor in the engine, a byte count (or nothing) in the planner's replay


class StepBackend(Protocol):
    """What the walk asks of whoever runs the step. `s`: a segment; `i`: a micro-batch; `x`: a
    segment's boundary input on the device (None for the first segment, which reads token
    ids). The head and backward compute one micro-batch per call; a forward computes its
    action's micro-batches one after another, the walk holding each output as it comes."""

    # -- weights and the action's frame --
    def begin(self, k: int, a: Action) -> None:
        """Action `k` is next: nothing of it has run yet."""

    def weights(self, k: int, s: int) -> Buf:
        """Segment `s`'s weights on the device for action `k`, waited for (loaded on a miss)."""

    def running(self, k: int, a: Action) -> AbstractContextManager:
        """Encloses action `k`'s compute, its landing and the loads it starts."""

    def prefetch(self, k: int) -> None:
        """Start loading what action `k` reads, where it fits without evicting."""

    def read_ahead(self, s: int) -> None:
        """Start reading segment `s`'s master and slots into host staging for its update."""

    # -- compute --
    def forward(self, a: Action, w: Buf, xs: Sequence[Buf]) -> Iterable[Buf]:
        """The segment's output for each micro-batch of `a` in turn (their inputs `xs`), each
        yielded before the next micro-batch runs."""

    def head(self, k: int, a: Action, i: int, w: Buf, x: Buf, grad: Buf, tied: Buf) -> Buf:
        """The loss of micro-batch `i` (kept by the backend); returns its gradient at the
        head's input. The head's own gradient accumulates in `grad`, the borrowed weights' in
        `tied` (None without trained ties)."""

    def backward(self, a: Action, i: int, w: Buf, x: Buf, gout: Buf, grad: Buf) -> Buf:
        """The gradient at the segment's input (given `gout` at its output); the segment's own
        accumulates in `grad`."""

    # -- activations on the device --
    def hold(self, t: Buf, boundary: int | None) -> None:
        """`t` is held on the device: segment `boundary`'s input, or (None) a gradient at a
        boundary."""

    def drop(self, t: Buf, boundary: int | None) -> None:
        """`t`, held as `hold` said, is released."""

    def park(self, s: int, x: Buf) -> Buf:
        """Start copying segment `s`'s input `x` to the host; returns the host copy."""

    def wait_parked(self, copy: Buf) -> None:
        """The copy `park` started has read its source."""

    def unpark(self, s: int, copy: Buf) -> tuple[Buf, Buf]:
        """Start copying segment `s`'s input back to the device from its host copy, after the
        compute queued so far: (its device copy, the copy's event). Compute reads it only
        after `arrived`."""

    def arrived(self, s: int, event: Buf) -> None:
        """Compute waits for the copy `unpark` started (its event)."""

    def release_parked(self, copy: Buf) -> None:
        """The host copy of a brought-back input is freed (the backward that reads the input
        has been issued)."""

    # -- gradients --
    def grad_buffer(self, s: int) -> Buf:
        """Where an action's gradient of segment `s` accumulates."""

    def tied_grad(self) -> Buf:
        """A zeroed device buffer the size of the tied weights' owner's gradient."""

    def add_grad(self, grad: Buf, part: Buf) -> None:
        """`grad += part`, then `part` (a `tied_grad` buffer) is freed."""

    def land(self, s: int, grad: Buf, final: bool) -> None:
        """Send an action's gradient of segment `s` towards its optimizer's tier."""


@dataclass(frozen=True, kw_only=True)
class StepRules:
    """What the walk needs beyond the actions: the engine's and the replay's own answers."""

    micro_batches: int
    parked: frozenset[int]
    """Segments whose boundary input waits on the host (tierlm.runtime.schedule.parked_inputs)."""
    tied_owners: Sequence[int]
    """Segments whose weights the head borrows, one entry per borrowed tensor."""
    tied_trained: bool
    """The borrowed weights take a gradient (not a frozen base's)."""
    state_tiers: Sequence[Tier]
    """Where each segment's state lives."""
    first_trained: bool
    """The first segment runs a backward (tierlm.runtime.schedule.runs_backward)."""


def walk_step(backend: StepBackend, actions: Sequence[Action], rules: StepRules,
              readahead: Mapping[int, Sequence[int]]) -> None:
    """Run one step's `actions` on `backend`; `readahead`: action index -> segments whose
    update state is read after it (tierlm.runtime.readahead.readahead_starts)."""
    _Walk(backend, rules).run(actions, readahead)


class _Walk:
    def __init__(self, backend: StepBackend, rules: StepRules) -> None:
        self.b = backend
        self.rules = rules
        # (micro-batch, segment) -> ...
        self.inputs: dict[tuple[int, int], Buf] = {}  # the segment's input on the device
        self.parked: dict[tuple[int, int], Buf] = {}  # its host copy, until brought back
        # brought back: (host copy, the copy's event), until its backward has been issued
        self.returning: dict[tuple[int, int], tuple[Buf, Buf]] = {}
        # the backward's reads of parked inputs, in order: each starts back while the one before
        # it computes (one micro-batch ahead)
        self.upcoming: deque[tuple[int, int]] = deque()
        self.grads: dict[tuple[int, int], Buf] = {}  # the loss's gradient at its input
        # micro-batch -> the head's buffer holding the tied weights' gradient, until the owner's
        # backward for that micro-batch adopts it or adds it into its own
        self.borrowed: dict[int, Buf] = {}

    def run(self, actions: Sequence[Action], readahead: Mapping[int, Sequence[int]]) -> None:
        b = self.b
        self.upcoming = deque((i, a.seg) for a in actions if a.kind == "bwd"
                              and a.seg in self.rules.parked for i in a.mbs)
        for k, a in enumerate(actions):
            b.begin(k, a)
            grad = None
            if a.kind == "bwd":
                if not grad_from_head(a.seg, self.rules.tied_trained,
                                      self.rules.state_tiers[a.seg]):
                    grad = b.grad_buffer(a.seg)
                w = b.weights(k, a.seg)
            else:
                w = b.weights(k, a.seg)
                if a.kind == "head":
                    grad = b.grad_buffer(a.seg)
                    for owner in self.rules.tied_owners:
                        b.weights(k, owner)
            with b.running(k, a):
                if a.kind == "fwd":
                    self.forward(a, w)
                elif a.kind == "head":
                    self.head(k, a, w, grad)
                else:
                    self.backward(a, w, grad)
                b.prefetch(k + 1)
                for s in readahead.get(k, ()):
                    b.read_ahead(s)

    def forward(self, a: Action, w: Buf) -> None:
        s = a.seg
        xs = [self.inputs.get((i, s)) for i in a.mbs]
        for i, y in zip(a.mbs, self.b.forward(a, w, xs), strict=True):
            self.hold_input(i, s + 1, y)  # before the next micro-batch runs
        for i in a.mbs:  # the group has read its inputs: the parked ones leave the device
            copy = self.parked.get((i, s))
            if copy is not None:
                self.b.wait_parked(copy)  # before the memory is reused
                self.drop_input(i, s)

    def head(self, k: int, a: Action, w: Buf, grad: Buf) -> None:
        s = a.seg
        for i in a.mbs:
            tied = self.b.tied_grad() if self.rules.tied_trained else None
            dx = self.b.head(k, a, i, w, self.inputs[(i, s)], grad, tied)
            if tied is not None:
                self.borrowed[i] = tied
            self.hold_grad(i, s, dx)
            self.drop_input(i, s)
        self.b.land(s, grad, final=final_landing(a, self.rules.micro_batches))

    def backward(self, a: Action, w: Buf, grad: Buf) -> None:
        """`grad` None: the owner of tied weights adopts the head's buffer of its first
        micro-batch as its gradient."""
        s = a.seg
        owns_borrowed = s == 0 and bool(self.borrowed)
        returned = []  # the host copies of the inputs brought back, freed after the loop
        for i in a.mbs:
            # The owner of tied weights sums its own and the head's contribution for this
            # micro-batch first, as autograd does for a tensor used twice in a graph: its backward
            # accumulates into the buffer holding the head's (x + y is y + x in IEEE arithmetic,
            # so the bits are autograd's own + head), which then joins the gradient.
            target = self.borrowed.pop(i) if owns_borrowed else grad
            x = None if s == 0 else self.input(i, s)
            self.bring_back_next()
            dx = self.b.backward(a, i, w, x, self.grads[(i, s + 1)], target)
            self.drop_grad(i, s + 1)
            if s > 0:
                if runs_backward(s - 1, self.rules.first_trained):
                    self.hold_grad(i, s, dx)
                self.drop_input(i, s)
                if (i, s) in self.returning:
                    returned.append(self.returning.pop((i, s))[0])
            if owns_borrowed and grad is None:
                grad = target  # a fresh zeroed gradient plus `target` is `target`
            elif owns_borrowed:
                self.b.add_grad(grad, target)
        # after the action's backwards, not between them: freeing a pinned range lets the
        # simulated device land every copy queued (tierlm.memory.device), which would hide a
        # missing wait for the next input's copy
        for copy in returned:
            self.b.release_parked(copy)
        self.b.land(s, grad, final=final_landing(a, self.rules.micro_batches))

    # -- what is held between actions --

    def hold_input(self, i: int, s: int, x: Buf, *, park: bool = True) -> None:
        """Segment `s`'s input, held until its backward; where it parks, its copy to the host
        starts now (the head's input is used at once and stays)."""
        self.inputs[(i, s)] = x
        self.b.hold(x, s)
        if park and s in self.rules.parked:
            self.parked[(i, s)] = self.b.park(s, x)

    def input(self, i: int, s: int) -> Buf:
        """Segment `s`'s input for its backward: if it was parked (the forward of `s` has run
        since it was produced, so its copy is on the host by now), brought back here unless the
        micro-batch before did, and waited for."""
        if (i, s) in self.parked:
            self.bring_back(i, s)
        if self.upcoming and self.upcoming[0] == (i, s):
            self.upcoming.popleft()
        returned = self.returning.get((i, s))
        if returned is not None:
            self.b.arrived(s, returned[1])
        return self.inputs[(i, s)]

    def bring_back(self, i: int, s: int) -> None:
        """Start segment `s`'s parked input of micro-batch `i` back to the device; it is held
        there from now on (the backward drops it)."""
        copy = self.parked.pop((i, s))
        x, event = self.b.unpark(s, copy)
        self.hold_input(i, s, x, park=False)
        self.returning[(i, s)] = (copy, event)

    def bring_back_next(self) -> None:
        """The next parked input the backward reads starts back now, so its copy runs under the
        compute issued next (one more boundary on the device meanwhile). One not parked yet (a
        micro-batch-outer step's next micro-batch has not run its forward) comes back at its
        use."""
        if self.upcoming and self.upcoming[0] in self.parked:
            self.bring_back(*self.upcoming[0])

    def drop_input(self, i: int, s: int) -> None:
        x = self.inputs.pop((i, s), None)
        if x is not None:
            self.b.drop(x, s)

    def hold_grad(self, i: int, s: int, g: Buf) -> None:
        self.grads[(i, s)] = g
        self.b.hold(g, None)

    def drop_grad(self, i: int, s: int) -> None:
        g = self.grads.pop((i, s), None)
        if g is not None:
            self.b.drop(g, None)

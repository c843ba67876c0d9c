"""Device slots for streamed compute weights, evicted by the schedule, not by recency.

The engine knows the whole step's order of segment uses before it starts (the schedule is a pure
function of the segments, the micro-batch count and the micro-batch order), so eviction picks
the cached segment whose next use is furthest away (Belady's rule). Prefetch runs while the
action before runs: it loads the next action's segments, evicting ahead by the same rule, and
issues their uploads at once.

A slot is a byte buffer of the segment's device copy: its compute copy in the precision its
weights compute in (tierlm.precision.streaming), or fp32. Each slot carries the event after the
last action that read it (`reads_done`): an upload into an evicted slot of the same size waits
for that event only, not for all compute queued so far, so it runs under the compute of the
action in between. A slot of another size is freed and a new buffer taken; an upload into fresh
memory waits for the compute queued so far (that memory may have been an activation still in
use).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from tierlm.memory.device import AFTER_COMPUTE
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier

STREAM_SLOTS = 2  # the segment running and the one being prefetched


def window_bytes(copy_bytes: Iterable[int], slots: int = STREAM_SLOTS) -> int:
    """The cache's capacity: room for the `slots` largest of the streamed segments' device
    copies (`copy_bytes`, one per streamed segment). The engine sizes its cache by it, and
    placement and the planner's replay count the device's streaming window by it."""
    return sum(sorted(copy_bytes, reverse=True)[:slots])


class PendingLoad(Protocol):
    def start(self, dst: torch.Tensor, after: Sequence[Any] | None) -> None:
        """Issue what can be issued now into `dst` (an upload from a host source), after the
        events `after` (AFTER_COMPUTE: the compute queued so far)."""
        ...

    def finish(self, dst: torch.Tensor) -> None:
        """Issue the rest and make compute wait for all of it."""
        ...


class StreamCache:
    def __init__(
        self,
        store: Store,
        nbytes: Callable[[int], int],
        capacity_bytes: int,
        start_load: Callable[[int], PendingLoad],
        ready: Callable[[int], bool] = lambda s: True,
        reusable: Callable[[int], bool] = lambda s: True,
    ) -> None:
        self.store = store
        # streamed segment -> bytes of its device copy, asked when its slot is taken (after its
        # update: a layer switched from fp8 to bf16 changes it)
        self.nbytes = nbytes
        self.capacity_bytes = capacity_bytes
        self.start_load = start_load
        self.ready = ready  # False while the segment's optimizer update is still running
        # False where a saved graph may still hold the segment's weights for a backward (an
        # activation policy that keeps its graph): its slot is freed, never overwritten
        self.reusable = reusable
        self.entries: dict[int, torch.Tensor] = {}
        self.pending: dict[int, PendingLoad] = {}
        self.used_bytes = 0
        self._held: dict[int, int] = {}  # cached segment -> bytes its slot was allocated with
        # cached segment -> the event after the last action that read its slot (None: no
        # compute has read it since it was loaded)
        self._read: dict[int, Any] = {}
        self.loads = 0  # segments fetched (the "swap" count)
        self.fetches: dict[int, int] = {}  # per segment, since the last `begin` (one step)
        self._uses: dict[int, list[int]] = {}
        self._needs: list[list[int]] = []

    def begin(self, needs: list[list[int]]) -> None:
        """Install the upcoming access sequence: `needs[k]` = streamed segments action k uses."""
        self._needs = needs
        self._uses = {}
        self.fetches = {}
        for k, segs in enumerate(needs):
            for s in segs:
                self._uses.setdefault(s, []).append(k)

    def _next_use(self, s: int, k: int) -> float:
        uses = self._uses.get(s, [])
        i = bisect.bisect_right(uses, k)
        return uses[i] if i < len(uses) else math.inf

    def _bytes(self, s: int) -> int:
        return self.nbytes(s)

    def _victim(self, nbytes: int, k: int, protect: set[int]) -> int | None:
        """The cached segment to evict for `nbytes` more at action `k` (None: it fits)."""
        if self.used_bytes + nbytes <= self.capacity_bytes:
            return None
        victims = [s for s in self.entries if s not in protect]
        if not victims:
            raise RuntimeError(
                f"stream cache of {self.capacity_bytes} bytes cannot hold the segments one "
                "action needs at once; raise --device-budget"
            )
        # furthest next use first; among equals, what the action before did not read (the
        # victim prefetch would have taken, so an acquire that loads in its place, because the
        # segment's update was still running, evicts the same)
        before = set(self._needs[k - 1]) if 0 < k <= len(self._needs) else set()
        return max(victims, key=lambda s: (self._next_use(s, k), s not in before))

    def _take_slot(self, s: int, k: int, protect: set[int]) -> tuple[torch.Tensor, Any]:
        """A slot for segment `s` at action `k`, evicting by next use (never `protect`), and
        the events an upload into it waits for."""
        nbytes = self._bytes(s)
        after: Sequence[Any] | None = AFTER_COMPUTE
        while (victim := self._victim(nbytes, k, protect)) is not None:
            if (self._held[victim] == nbytes and victim not in self.pending
                    and victim in self._read and self.reusable(victim)):
                # the same size, read since it was loaded: its buffer, once its last reader is
                # done
                buf, after = self.entries.pop(victim), [self._read.pop(victim)]
                self.used_bytes -= self._held.pop(victim)
                break
            self.drop(victim)
        else:
            buf = self.store.alloc(Tier.DEVICE, TensorClass.COMPUTE, nbytes, torch.uint8)
        self._held[s] = nbytes
        self.used_bytes += nbytes
        self.entries[s] = buf
        self.loads += 1
        self.fetches[s] = self.fetches.get(s, 0) + 1
        return buf, after

    def acquire(self, k: int, s: int) -> torch.Tensor:
        """The device copy of segment `s` for action `k`, loading it (and evicting) if needed."""
        if s in self.pending:
            self.pending.pop(s).finish(self.entries[s])
        if s not in self.entries:
            load = self.start_load(s)
            buf, after = self._take_slot(s, k, protect=set(self._needs[k]))
            load.start(buf, after)
            load.finish(buf)
        return self.entries[s]

    def reads_done(self, k: int) -> None:
        """Action `k` has issued all its compute: its slots' last reader is known (an event
        after it)."""
        if k < 0 or k >= len(self._needs):
            return
        segs = [s for s in self._needs[k] if s in self.entries]
        if segs:
            event = self.store.dev.mark()
            for s in segs:
                self._read[s] = event

    def prefetch(self, k: int) -> None:
        """Start loading what action `k` needs (issued while action k - 1 runs), evicting
        ahead by next use what action `k` does not read: the choice `acquire` would make, so
        a prefetch skipped (the segment's update still running) changes no fetch. Evicting
        what action k - 1 reads is allowed: the upload then waits for that action."""
        if k >= len(self._needs):
            return
        protect = set(self._needs[k])
        for s in self._needs[k]:
            if s in self.entries or not self.ready(s):
                continue  # not ready: its weights are still being updated; acquire waits
            load = self.start_load(s)
            buf, after = self._take_slot(s, k, protect)
            load.start(buf, after)
            self.pending[s] = load

    def drop(self, s: int) -> None:
        buf = self.entries.pop(s, None)
        if buf is None:
            return
        if s in self.pending:
            self.pending.pop(s).finish(buf)  # complete the copy before the buffer is released
        self._read.pop(s, None)
        self.store.free(Tier.DEVICE, TensorClass.COMPUTE, buf)
        self.used_bytes -= self._held.pop(s)

    def drop_all(self) -> None:
        for s in list(self.entries):
            self.drop(s)

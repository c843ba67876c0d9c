"""Device slots for streamed compute weights, evicted by the schedule, not by recency.

The engine knows the whole step's order of segment uses before it starts (the schedule is a pure
function of the segments, the micro-batch count and the micro-batch order), so eviction picks
the cached segment whose next use is furthest away (Belady's rule), and prefetch loads the next
action's segments whenever they fit without evicting anything needed sooner.

A slot is a byte buffer of the segment's device copy: its compute copy in the precision its
weights compute in (tierlm.precision.streaming), or fp32.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier

STREAM_SLOTS = 2  # the segment running and the one being prefetched


def window_bytes(copy_bytes: Iterable[int], slots: int = STREAM_SLOTS) -> int:
    """The cache's capacity: room for the `slots` largest of the streamed segments' device
    copies (`copy_bytes`, one per streamed segment). The engine sizes its cache by it, and
    placement and the planner's replay count the device's streaming window by it."""
    return sum(sorted(copy_bytes, reverse=True)[:slots])


class PendingLoad(Protocol):
    def finish(self, dst: torch.Tensor) -> None: ...


class StreamCache:
    def __init__(
        self,
        store: Store,
        nbytes: Callable[[int], int],
        capacity_bytes: int,
        start_load: Callable[[int], PendingLoad],
        ready: Callable[[int], bool] = lambda s: True,
    ) -> None:
        self.store = store
        # streamed segment -> bytes of its device copy, asked when its slot is taken (after its
        # update: a layer switched from fp8 to bf16 changes it)
        self.nbytes = nbytes
        self.capacity_bytes = capacity_bytes
        self.start_load = start_load
        self.ready = ready  # False while the segment's optimizer update is still running
        self.entries: dict[int, torch.Tensor] = {}
        self.pending: dict[int, PendingLoad] = {}
        self.used_bytes = 0
        self._held: dict[int, int] = {}  # cached segment -> bytes its slot was allocated with
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

    def _make_room(self, nbytes: int, k: int, protect: set[int]) -> None:
        while self.used_bytes + nbytes > self.capacity_bytes:
            victims = [s for s in self.entries if s not in protect]
            if not victims:
                raise RuntimeError(
                    f"stream cache of {self.capacity_bytes} bytes cannot hold the segments one "
                    "action needs at once; raise --device-budget"
                )
            self.drop(max(victims, key=lambda s: self._next_use(s, k)))

    def _reserve(self, s: int) -> torch.Tensor:
        buf = self.store.alloc(Tier.DEVICE, TensorClass.COMPUTE, self._bytes(s), torch.uint8)
        self._held[s] = self._bytes(s)
        self.used_bytes += self._held[s]
        self.entries[s] = buf
        self.loads += 1
        self.fetches[s] = self.fetches.get(s, 0) + 1
        return buf

    def acquire(self, k: int, s: int) -> torch.Tensor:
        """The device copy of segment `s` for action `k`, loading it (and evicting) if needed."""
        if s in self.pending:
            self.pending.pop(s).finish(self.entries[s])
        if s not in self.entries:
            self._make_room(self._bytes(s), k, protect=set(self._needs[k]))
            self.start_load(s).finish(self._reserve(s))
        return self.entries[s]

    def prefetch(self, k: int) -> None:
        """Start loading what action `k` needs, if it fits without evicting anything."""
        if k >= len(self._needs):
            return
        for s in self._needs[k]:
            if s in self.entries or not self.ready(s):
                continue  # not ready: its weights are still being updated; acquire waits
            if self.used_bytes + self._bytes(s) > self.capacity_bytes:
                continue
            load = self.start_load(s)
            self._reserve(s)
            self.pending[s] = load

    def drop(self, s: int) -> None:
        buf = self.entries.pop(s, None)
        if buf is None:
            return
        if s in self.pending:
            self.pending.pop(s).finish(buf)  # complete the copy before the buffer is released
        self.store.free(Tier.DEVICE, TensorClass.COMPUTE, buf)
        self.used_bytes -= self._held.pop(s)

    def drop_all(self) -> None:
        for s in list(self.entries):
            self.drop(s)

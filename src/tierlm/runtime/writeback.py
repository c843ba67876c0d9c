"""The deferred write-back (issue J): a disk-tier segment's update ends as soon as what its next
forward reads is on disk (its compute file; the master file where it computes from fp32), and its
master and optimizer slots go back to their files behind the rest of the step.

Every segment's forward waits for its update, so with the write-back inside the update the next
step's first forward had to hide the whole update's disk work. Here one background thread takes
each update's staged master and slots, in update order, writes them back in pieces (so the
forward's reads and the next update's requests queue behind one piece, not a segment), and frees
the staging when a segment's writes have landed.

Host RAM: staging now outlives the update, so it is bounded by `WriteBack.segments`: the update
of a disk-tier segment first waits until fewer than that many write-backs are pending. The
planner (tierlm.plan) counts that many segments' master and slots in its host peak.

Hazards: whatever reads a segment's master or slot files waits for its pending write-back
(`Writer.wait`: the next update of it, the read-ahead; `Writer.drain`: checkpoints, evaluation,
export, load, close); a failed write re-raises from those waits, in the thread that waits (the
update worker's failure reaches the training thread through the update's future).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier

PIECE_BYTES = 32 << 20  # one write-back request in flight at a time: 4 disk chunks of 8 MiB


@dataclass(frozen=True, kw_only=True)
class WriteBack:
    segments: int = 1
    """How many disk-tier segments' write-backs may be pending at once (each holds its staged
    master and slots in host RAM until written); the update of another disk segment first waits
    for the oldest."""

    def __post_init__(self) -> None:
        if self.segments < 1:
            raise ValueError(f"WriteBack.segments must be at least 1, got {self.segments}")


DEFAULT_WRITEBACK = WriteBack(segments=1)
"""The engine's and the planner's default: one segment's write-back behind the next forward,
no more staging than the update itself held before."""


def deferred_copies(state_copies: tuple[str, ...], has_compute_copy: bool) -> tuple[str, ...]:
    """The copies of a disk-tier update written behind the step: master and slots where the
    forward reads a compute copy; only the slots where it reads the fp32 master file."""
    return state_copies if has_compute_copy else state_copies[1:]


class Writer:
    """One thread writing staged copies back to their files, first in, first out."""

    def __init__(self, store: Store, limit: int, piece_bytes: int = PIECE_BYTES) -> None:
        self.store = store
        self.limit = limit
        self.piece_bytes = piece_bytes
        self._pool = store.dev.worker("writeback")  # a thread (inline on a simulated device)
        self._latest: dict[int, Future] = {}  # segment -> its last write-back
        self._queue: deque[Future] = deque()  # submitted and not yet seen done (update worker)

    def submit(self, st, bufs: dict[str, torch.Tensor]) -> None:
        """Write `bufs` ({copy: staged flat buffer}) of disk-tier segment `st` back, then free
        them. Called by the update worker, in update order."""
        fut = self._pool.submit(self._write, st, bufs)
        self._latest[st.index] = fut
        self._queue.append(fut)

    def make_room(self) -> None:
        """Wait until fewer than `limit` write-backs are pending (update worker, before it
        stages the next segment)."""
        while self._queue and (len(self._queue) >= self.limit or self._queue[0].done()):
            self._queue.popleft().result()

    def wait(self, s: int) -> None:
        """Segment `s`'s pending write-back is on disk (re-raising its failure)."""
        fut = self._latest.get(s)
        if fut is not None:
            fut.result()

    def drain(self) -> None:
        """Every write-back submitted so far is on disk (no update may be running)."""
        for fut in list(self._latest.values()):
            fut.result()
        self._queue.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, st, bufs: dict[str, torch.Tensor]) -> None:
        try:
            for c, buf in bufs.items():
                raw = buf.view(torch.uint8)
                for lo in range(0, raw.numel(), self.piece_bytes):
                    piece = raw[lo : lo + self.piece_bytes]
                    self.store.write_file(st.file(c), piece, st.slot(c).cls, lo).result()
        finally:
            for buf in bufs.values():
                self.store.free(Tier.HOST, TensorClass.STAGING, buf)

"""The update's read-ahead (issue J): the update state (master and the optimizer's slots) of
disk-tier segments is read into host staging during the backward, so the update finds it in RAM
and its remaining disk work is the write-back behind the next forward.

Exact clipping needs the global norm, so no update starts before the backward ends; but master
and slots do not change between the last update's write-back and the next update, so they can be
read while the backward runs. The reads take host RAM until the update has written them back:
`ReadAhead.extra_bytes` of it from the last micro-batch group's start of the backward (its head
action) on, plus what that backward frees as it goes (boundary inputs parked on the host, brought
back and dropped). Segments are read in the order the updates consume them (forward order after
the backward; with speculative updates, each issued as its gradient's final landing is done, the
backward's order, last segment first, and only those whose update has not started), and the
first one that never fits ends the read-ahead, so the update order is unchanged.

`readahead_starts` is a pure function of the schedule: the engine issues the reads where it says,
and the planner's replay (tierlm.runtime.byte_replay._simulate) counts them at the same actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class ReadAhead:
    extra_bytes: int = 0
    """Host bytes the read-ahead may hold beyond what the last group's backward has freed."""


class _Action(Protocol):
    kind: str
    seg: int
    mbs: tuple[int, ...]


def readahead_starts(
    actions: Sequence[_Action], sizes: Sequence[tuple[int, int]], extra_bytes: int, *,
    parked_input_bytes: int = 0, speculative: bool = False,
) -> dict[int, list[int]]:
    """Action index -> the segments whose update state is read right after that action.

    `sizes`: (segment, bytes of its master and slots) of the disk-tier segments;
    `parked_input_bytes`: bytes of one micro-batch's boundary input parked on the host (0 when
    boundaries wait on the device), which each backward action of a block frees per
    micro-batch it runs. The segments are read in the order their updates consume them:
    forward order, the update's after the backward; `speculative` (each disk-tier update
    issued at its gradient's final landing): the order the backward completes them, the last
    segment first, leaving out each whose update has started by the action a read would follow
    (the last backward action of its segment). In forward order a speculating step read ahead
    the segments whose updates come last while the first ones read their state at the drive;
    7B bf16 at 64 GiB, simulated: 53.96 s in forward order, 51.71 s so, 51.27 s with no
    read-ahead, and with 8 GiB for it 50.80 s against 53.58 s."""
    heads = [k for k, a in enumerate(actions) if a.kind == "head"]
    if not heads or not sizes:
        return {}
    last = max(a.seg for a in actions)
    # the action after which a segment's update has started (speculative: its gradient's last
    # backward action); never, for the update after the backward
    started = {a.seg: k for k, a in enumerate(actions)
               if a.kind in ("bwd", "head")} if speculative else {}
    allowance, held, todo = extra_bytes, 0, sorted(sizes, reverse=speculative)
    starts: dict[int, list[int]] = {}
    for k in range(heads[-1], len(actions)):
        a = actions[k]
        if a.kind == "bwd" and 0 < a.seg < last:
            allowance += parked_input_bytes * len(a.mbs)
        while todo and started.get(todo[0][0], len(actions)) <= k:
            todo.pop(0)  # its update has started: nothing left to read ahead for it
        while todo and held + todo[0][1] <= allowance:
            seg, nbytes = todo.pop(0)
            held += nbytes
            starts.setdefault(k, []).append(seg)
    return starts

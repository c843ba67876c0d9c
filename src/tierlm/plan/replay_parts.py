"""The timed replay's stand-ins (tierlm.plan.replay): a store whose device books every copy, wait
and disk request on the `TimingDevice`'s timeline, a segment's state as byte-count buffers, and
the step's timing read off the timeline (lane busy time, overlap with compute)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tierlm.memory.device import AFTER_COMPUTE, TimingDevice, nbytes_of
from tierlm.memory.layout import FlatLayout
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import (
    SegmentPlacement,
)
from tierlm.memory.simulator import COMPUTE, D2H, DISK, H2D, NET_RECV, NET_SEND, NODE_CPU, Op
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.runtime.byte_replay import _Bytes, _CountingStore
from tierlm.runtime.state import GRAD, MASTER, generation_file


@dataclass
class StepTiming:
    """The replay's steady-state step (the second of `STEPS`) in virtual seconds."""

    step_s: float  # from the step's start to the next one's (the training thread's clock)
    lane_busy_s: dict[str, float]  # each lane's busy time within the step
    overlap_s: dict[str, float]  # each copy lane's busy time that overlaps compute's
    transfer_wait_s: float  # compute idle, waiting for copies
    start_s: float = 0.0  # when the step starts on the timeline (its ops' clock)
    ops: list[Op] = field(default_factory=list, repr=False)  # the step's operations
    steps: list[dict[str, float]] = field(default_factory=list, repr=False)  # end_step's
    step_ops: list[list[Op]] = field(default_factory=list, repr=False)  # every step's ops

    @property
    def compute_s(self) -> float:
        return self.lane_busy_s.get(COMPUTE, 0.0)


def _done() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut


class _Disk:
    """What the runtime asks of the store's disk tier: whether it moves whole blocks."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct


def _timing_store(ledger: Ledger, dev: TimingDevice, direct: bool):
    class TimingStore(_CountingStore):
        """`_CountingStore` with the store's copies and disk requests, booked on `dev`."""

        def __init__(self) -> None:
            super().__init__(ledger)
            self.dev = dev
            self.device = dev.torch_device
            self.disk = _Disk(direct)

        def zeros(self, tier: Tier, cls: TensorClass, numel: int):
            return self.alloc(tier, cls, numel)

        def to_device(self, dst, src, what: str = "", *,
                      after: Sequence[Any] | None = AFTER_COMPUTE):
            ledger.record_move(Link.H2D, nbytes_of(src))
            return dev.copy(dst, src, Link.H2D, what, after=after)

        def to_host(self, dst, src, what: str = "", *,
                    after: Sequence[Any] | None = AFTER_COMPUTE):
            ledger.record_move(Link.D2H, nbytes_of(src))
            return dev.copy(dst, src, Link.D2H, what, after=after)

        def wait(self, event, what: str = "") -> None:
            dev.wait(event, what)

        def wait_host(self, event, what: str = "") -> None:
            dev.wait_host(event, what)

        def reserve_file(self, name: str, nbytes: int, cls: TensorClass) -> None:
            pass

        def read_file(self, name: str, dst, offset_bytes: int = 0) -> Future:
            ledger.record_move(Link.DISK_READ, nbytes_of(dst))
            return dev.io(_done(), Link.DISK_READ, nbytes_of(dst), name)

        def write_file(self, name: str, src, cls: TensorClass, offset_bytes: int | None = None
                       ) -> Future:
            ledger.record_move(Link.DISK_WRITE, nbytes_of(src))
            return dev.io(_done(), Link.DISK_WRITE, nbytes_of(src), name)

    return TimingStore()


class _Format:
    """A compute copy's size, all `start_load`'s loaders ask of its format."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _State:
    """What the runtime's loaders, stream_chunks, CopiesRead and the update read of a
    SegmentState: its name, size, placement, compute copy, the optimizer's slots over a flat
    layout of its parameters (1-D: an elementwise slot's chunks and spans do not depend on the
    shapes) and its host buffers as byte counts."""

    def __init__(self, s: int, name: str, params: Sequence[tuple[str, int]],
                 placement: SegmentPlacement, copy_bytes: int | None, slots: tuple) -> None:
        self.index, self.placement = s, placement
        self.seg = SimpleNamespace(name=name)
        self.tier = placement.state_tier
        self.layout = FlatLayout([(p, (n,), True) for p, n in params])
        self.numel = self.layout.numel
        self.slots = slots
        self.compute_format = None if copy_bytes is None else _Format(copy_bytes)
        on_host = self.tier == Tier.HOST
        self.master = _Bytes(self.numel) if self.tier != Tier.DISK else None
        self.grad = _Bytes(self.numel) if on_host or placement.host_grad else None
        self.state = {sl.name: _Bytes(sl.numel(self.layout), dtype=sl.dtype) for sl in slots
                      } if self.tier != Tier.DISK else {}
        self.wire = _Bytes(copy_bytes, 1) if on_host and copy_bytes is not None else None
        self.device_weights = None
        if placement.resident:
            self.device_weights = _Bytes(self.device_nbytes(), 1)
        self.device_stale = False
        self.read_done = None  # SegmentState.read_done
        self.grad_written = False
        self.generation = 0  # SegmentState.generation

    @property
    def state_copies(self) -> tuple[str, ...]:
        return ("master", *(sl.name for sl in self.slots))

    def device_nbytes(self) -> int:
        return self.numel * 4 if self.compute_format is None else self.compute_format.nbytes

    def file(self, copy: str) -> str:
        return generation_file(self.seg.name, copy, self.generation)

    def spare(self) -> _State:  # SegmentState.spare
        other = copy.copy(self)
        other.generation ^= 1
        return other

    def slot(self, copy: str):
        if copy == "master":
            return MASTER
        if copy == "grad":
            return GRAD
        return next(sl for sl in self.slots if sl.name == copy)

    def buffer(self, copy: str):
        return getattr(self, copy) if copy in ("master", "grad") else self.state[copy]


def _timing(dev: TimingDevice, results: list[dict[str, float]]) -> StepTiming:
    ops = dev.step_ops
    last = results[-1]
    busy = {COMPUTE: last["sim_compute_s"], H2D: last["sim_h2d_s"], D2H: last["sim_d2h_s"],
            DISK: last["sim_disk_s"], "cpu update": last["sim_cpu_update_s"],
            "cpu": last["sim_cpu_s"]}
    for lane in (NET_SEND, NET_RECV, NODE_CPU):  # with a memory node only
        key = f"sim_{lane.replace(' ', '_')}_s"
        if key in last:
            busy[lane] = last[key]
    compute = sorted((op.start_s, op.end_s) for op in ops if op.lane == COMPUTE)
    overlap = {lane: _overlap([(op.start_s, op.end_s) for op in ops if op.lane == lane],
                              compute) for lane in (H2D, D2H, DISK)}
    return StepTiming(step_s=last["sim_step_s"], lane_busy_s=busy, overlap_s=overlap,
                      transfer_wait_s=last["sim_transfer_wait_s"],
                      start_s=dev.step_window_s[0], ops=ops, steps=results)


def _overlap(spans: list[tuple[float, float]], under: list[tuple[float, float]]) -> float:
    """Seconds of `spans` that lie under `under` (sorted, disjoint intervals)."""
    import bisect

    starts = [a for a, _ in under]
    total = 0.0
    for a, b in spans:
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(under) and under[i][0] < b:
            lo, hi = max(a, under[i][0]), min(b, under[i][1])
            total += max(0.0, hi - lo)
            i += 1
    return total

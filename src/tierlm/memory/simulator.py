"""A GPU's step in virtual time: streams, events, copy engines, the disk and CPU lanes.

The planner and the simulated device (`--device sim:PROFILE`, tierlm.memory.device) issue the
same operations to a `Timeline`, which keeps CUDA's ordering rules in virtual seconds:

- a **stream** runs its operations one after another, each starting once the stream's previous
  one has ended, the host has issued it and every event it waits for has happened;
- a **lane** is the hardware an operation occupies: the compute units, one copy engine per
  direction (H2D, D2H), the drive (reads and writes share it), one CPU lane per host thread,
  and with a memory node (tierlm.node) the link to it, one lane per direction (full duplex),
  and the node's CPU.
  A lane runs one operation at a time; an operation takes the earliest gap of its length at or
  after the moment it is ready (operations issued from several threads interleave);
- an **event** is a point on a stream (what the stream had queued when it was recorded);
  waiting for it on a stream delays that stream's next operation, waiting on the host advances
  the host clock;
- the **host** has a clock per thread of the step: the training thread issues work at its own
  time, which advances only when it waits or does CPU work itself (the Python that issues
  kernels takes no virtual time, as a GPU run's host runs ahead of the device).

Durations are bytes over the profile's rates (copies at `COPY_EFFICIENCY` of the link), FLOPs
over the profile's matmul rate in the run's precision (at `MATMUL_EFFICIENCY`), parameters over
the CPU's AdamW rate. Every operation is kept as a `TraceEvent`, so a step's timeline is both the
planner's prediction and a Perfetto trace (tierlm.trace).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.tiers import Link

MATMUL_EFFICIENCY = 0.45  # achieved / peak matmul rate for transformer blocks (typical MFU)
COPY_EFFICIENCY = 0.9  # pinned copies reach ~90% of the profile's practical rate

COMPUTE = "compute"
H2D = "H2D"
D2H = "D2H"
DISK = "disk"
NET_SEND = "net send"  # trainer -> memory node
NET_RECV = "net recv"  # memory node -> trainer
NODE_CPU = "node cpu"  # the memory node's optimizer updates
LINK_LANE = {Link.H2D: H2D, Link.D2H: D2H, Link.DISK_READ: DISK, Link.DISK_WRITE: DISK,
             Link.NET_SEND: NET_SEND, Link.NET_RECV: NET_RECV}


@dataclass(frozen=True)
class Rates:
    """What one unit of work costs on each lane, from a hardware profile and the run's
    precision."""

    h2d_Bps: float
    d2h_Bps: float
    disk_read_Bps: float
    disk_write_Bps: float
    host_copy_Bps: float  # a CPU add of a landed gradient chunk reads two buffers, writes one
    cpu_adam_params_per_s: float
    flops: float  # matmul FLOPs per second in the run's compute precision
    block_flops: float  # the blocks' matmul rate (fp8 units where the run computes in fp8)
    # the link to the memory node, payload bytes per second each way (None: no node), and the
    # node's AdamW-equivalent update rate
    net_Bps: float | None = None
    node_cpu_params_per_s: float | None = None

    @classmethod
    def of(cls, hw: HardwareProfile, precision: str = "bf16", *, tf32: bool = False) -> Rates:
        peak = hw.fp32_compute_flops(tf32=tf32) if precision == "fp32" else hw.matmul_flops
        rate = peak * (1.0 if hw.device_is_cpu else MATMUL_EFFICIENCY)
        if hw.device_is_cpu and precision == "bf16":
            rate *= 1.5  # measured on the dev CPU: bf16 autocast ~1.5x fp32 (bench/step_time.py)
        block = rate
        if precision == "fp8" and hw.fp8_matmul_flops and not hw.device_is_cpu:
            block = hw.fp8_matmul_flops * MATMUL_EFFICIENCY
        copy = 1.0 if hw.device_is_cpu else COPY_EFFICIENCY
        node = hw.memory_node
        return cls(h2d_Bps=hw.h2d_Bps * copy, d2h_Bps=hw.d2h_Bps * copy,
                   disk_read_Bps=hw.disk_read_Bps, disk_write_Bps=hw.disk_write_Bps,
                   host_copy_Bps=hw.host_copy_Bps,
                   cpu_adam_params_per_s=hw.cpu_adam_params_per_s, flops=rate,
                   block_flops=block,
                   net_Bps=None if node is None else node.net_Bps,
                   node_cpu_params_per_s=None if node is None else (
                       node.cpu_adam_params_per_s or hw.cpu_adam_params_per_s))

    def link_s(self, link: Link, nbytes: int) -> float:
        if link in (Link.NET_SEND, Link.NET_RECV):
            if self.net_Bps is None:
                raise ValueError(f"a {link.value} transfer of {nbytes} bytes with no memory "
                                 "node in the time model (no link rate)")
            return nbytes / self.net_Bps
        rate = {Link.H2D: self.h2d_Bps, Link.D2H: self.d2h_Bps,
                Link.DISK_READ: self.disk_read_Bps, Link.DISK_WRITE: self.disk_write_Bps}[link]
        return nbytes / rate

    def node_s(self, params: float) -> float:
        """Seconds of the memory node's update of `params` AdamW-equivalent parameters."""
        if self.node_cpu_params_per_s is None:
            raise ValueError("a memory node's update with no memory node in the time model")
        return params / self.node_cpu_params_per_s


@dataclass
class Op:
    """One operation of the timeline (seconds of virtual time)."""

    lane: str
    name: str
    cat: str
    start_s: float
    end_s: float
    args: dict = field(default_factory=dict)


class Lane:
    """Hardware that runs one operation at a time: busy intervals, sorted, disjoint."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._starts: list[float] = []
        self._ends: list[float] = []
        self.busy_s = 0.0

    def book(self, ready_s: float, dur_s: float) -> float:
        """Take the earliest gap of `dur_s` at or after `ready_s`; returns its start."""
        i = bisect.bisect_right(self._ends, ready_s)
        t = ready_s
        while i < len(self._starts):
            if t + dur_s <= self._starts[i]:
                break
            t = max(t, self._ends[i])
            i += 1
        self._starts.insert(i, t)
        self._ends.insert(i, t + dur_s)
        self.busy_s += dur_s
        return t

    def forget_before(self, t_s: float) -> None:
        """Drop intervals that ended before `t_s` (nothing can be booked before it any more)."""
        i = bisect.bisect_right(self._ends, t_s)
        del self._starts[:i], self._ends[:i]


@dataclass(eq=False)
class Event:
    """A point on a stream: `t_s` when everything queued on it before the record has run;
    `seq` counts the stream's operations up to it."""

    stream: Stream
    t_s: float
    seq: int


class Stream:
    def __init__(self, name: str, lane: str) -> None:
        self.name, self.lane = name, lane
        self.t_s = 0.0
        self.seq = 0


class HostClock:
    """One host thread of the step: its time, and the CPU lane its own work occupies."""

    def __init__(self, lane: str, t_s: float = 0.0) -> None:
        self.lane = lane
        self.t_s = t_s


class Timeline:
    """Virtual time of one device (see the module's docstring)."""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self.lanes: dict[str, Lane] = {}
        self.streams = {name: Stream(name, lane) for name, lane in
                        ((COMPUTE, COMPUTE), (H2D, H2D), (D2H, D2H))}
        self.host = HostClock("cpu")  # the training thread
        self.ops: list[Op] = []
        self.recording = True
        self.wait_s = 0.0  # compute's idle time spent waiting for events (device-side waits)
        self.host_wait_s = 0.0  # the training thread's time blocked on the device or a lane

    def lane(self, name: str) -> Lane:
        if name not in self.lanes:
            self.lanes[name] = Lane(name)
        return self.lanes[name]

    @property
    def compute(self) -> Stream:
        return self.streams[COMPUTE]

    # -- issuing ----

    def _run(self, lane: str, ready_s: float, dur_s: float, name: str, cat: str,
             args: dict) -> tuple[float, float]:
        start = self.lane(lane).book(ready_s, dur_s)
        end = start + dur_s
        if self.recording:
            self.ops.append(Op(lane, name, cat, start, end, args))
        return start, end

    def on_stream(self, stream: str, dur_s: float, name: str, cat: str,
                  after: Iterable[Event | None] = (), **args) -> Event:
        """An operation on `stream` (its lane), issued by the current host thread now, after
        `after`'s events; returns the event just after it."""
        st = self.streams[stream]
        ready = max([st.t_s, self.host.t_s] + [e.t_s for e in after if e is not None])
        _, end = self._run(st.lane, ready, dur_s, name, cat, args)
        st.t_s = end
        st.seq += 1
        return Event(st, end, st.seq)

    def copy(self, link: Link, nbytes: int, name: str, after: Iterable[Event | None] = ()
             ) -> Event:
        """A copy of `nbytes` over `link` on its direction's stream."""
        return self.on_stream(LINK_LANE[link], self.rates.link_s(link, nbytes), name,
                              "transfer", after, bytes=nbytes)

    def compute_op(self, name: str, flops: float, *, block: bool = False) -> Event:
        rate = self.rates.block_flops if block else self.rates.flops
        return self.on_stream(COMPUTE, flops / rate, name, "compute", flops=flops)

    def mark(self, stream: str = COMPUTE) -> Event:
        st = self.streams[stream]
        return Event(st, st.t_s, st.seq)

    def wait(self, event: Event | None, stream: str = COMPUTE, what: str = "") -> None:
        """`stream`'s next operation starts after `event` (the host does not block)."""
        st = self.streams[stream]
        if event is None or event.t_s <= st.t_s:
            return
        ready = max(st.t_s, self.host.t_s)
        if event.t_s > ready and stream == COMPUTE:
            self.wait_s += event.t_s - ready
            if self.recording:
                self.ops.append(Op("wait", what or "wait", "transfer wait", ready, event.t_s))
        st.t_s = event.t_s

    def wait_host(self, t_s: float | None, what: str = "", cat: str = "host wait") -> None:
        """The current host thread blocks until `t_s`."""
        if t_s is None or t_s <= self.host.t_s:
            return
        self.host_wait_s += t_s - self.host.t_s
        if self.recording:
            self.ops.append(Op(f"{self.host.lane} wait", what or "wait", cat, self.host.t_s,
                               t_s))
        self.host.t_s = t_s

    def disk(self, link: Link, nbytes: int, name: str) -> float:
        """A disk request issued by the current host thread now; returns when it ends."""
        _, end = self._run(DISK, self.host.t_s, self.rates.link_s(link, nbytes), name,
                           "disk", {"bytes": nbytes, "link": link.value})
        return end

    def blocking(self, lane: str, dur_s: float, name: str, cat: str, **args) -> None:
        """Work of `dur_s` on `lane` that the current host thread starts now and waits for
        (a transfer to or from the memory node, the node's update): the thread's clock moves
        to its end."""
        _, end = self._run(lane, self.host.t_s, dur_s, name, cat, args)
        self.wait_host(end, name, f"{cat} wait")

    def cpu(self, dur_s: float, name: str, cat: str = "cpu") -> None:
        """Work of `dur_s` on the current host thread's CPU lane."""
        start, end = self._run(self.host.lane, self.host.t_s, dur_s, name, cat, {})
        self.host.t_s = end

    @contextlib.contextmanager
    def thread(self, lane: str, clock: HostClock) -> Iterator[HostClock]:
        """Work issued inside runs on another host thread (`clock`, its CPU lane `lane`),
        starting no earlier than the issuing thread's now."""
        caller = self.host
        clock.t_s = max(clock.t_s, caller.t_s)
        clock.lane = lane
        self.host = clock
        try:
            yield clock
        finally:
            self.host = caller

    def synchronize(self) -> None:
        """The host waits for every stream."""
        self.wait_host(max(s.t_s for s in self.streams.values()), "synchronize", "sync")

    # -- reading ----

    def now_s(self) -> float:
        return max([self.host.t_s] + [s.t_s for s in self.streams.values()])

    def window(self, start_s: float) -> list[Op]:
        return [op for op in self.ops if op.end_s > start_s]

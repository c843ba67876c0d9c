"""The device: every stream, event, wait and host synchronisation of a step goes through here.

The runtime (the store's copies, the stream cache, gradient landing, activation offload, the
update worker) asks one `Device` to copy, mark, wait and compute; nothing else in runtime/,
memory/, precision/, activations/ or optim/ calls a CUDA stream or event API or blocks the host
during a step (tests/runtime/test_no_stray_syncs.py holds that). Three devices answer:

- `HostDevice`: a CPU-only machine. The device is the CPU itself: copies are memcpys done when
  issued, events are None, waits return at once. Compute is timed on the wall clock.
- `CudaDevice`: compute runs on the current stream; host-to-device and device-to-host copies run
  on a stream each (a GPU has a copy engine per direction, so uploads do not queue behind
  gradient downloads). A copy waits only for the events it is given (`after`): an upload into a
  recycled slot waits for the last compute that read the slot, not for all compute queued so
  far. Compute is timed with CUDA events.
- `SimDevice` (`--device sim:PROFILE`): the real engine on CPU tensors, so every number stays
  exact, with CUDA's ordering kept in virtual time by a `Timeline` (tierlm.memory.simulator) at
  the profile's rates. A copy lands only when something waits for it (an event after it, on the
  device or on the host); until then its destination holds NaN (integers: all bits set), so a
  missing wait shows as a wrong loss, not as a race that happens to work on a CPU. The other
  race, an upload issued into a buffer that compute queued before it still reads, cannot change
  a number on a CPU (that compute ran when issued): the device records the bytes each compute
  region reads and refuses (`WriteAfterRead`) an upload that would start, in virtual time,
  before the last compute reading its destination ends. The update
  worker and the write-back run inline on host clocks of their own, so the timeline does not
  depend on how the OS schedules threads.

`TimingDevice` is `SimDevice` without tensors: the planner's replay (tierlm.plan.replay) runs
the engine's walk over byte counts on one, issuing the same operations, so the plan's simulated
step is the timeline the engine gives on `SimDevice`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierlm.memory.hardware import PROFILES, HardwareProfile
from tierlm.memory.simulator import (
    COMPUTE,
    D2H,
    DISK,
    H2D,
    LINK_LANE,
    NET_RECV,
    NET_SEND,
    NODE_CPU,
    HostClock,
    Rates,
    Timeline,
)
from tierlm.memory.tiers import Link
from tierlm.trace import NO_TRACER, NoTracer, Tracer

AFTER_COMPUTE = None
"""`copy(after=AFTER_COMPUTE)`: the copy waits for all compute queued so far (a download of what
compute just wrote)."""

SIM_PREFIX = "sim:"


def nbytes_of(t: Any) -> int:
    return t.numel() * t.element_size()


class Device:
    """The interface (a CPU-only machine's behaviour; the other devices override it)."""

    kind = "cpu"
    asynchronous = False  # copies may still run after `copy` returns
    timeline: Timeline | None = None

    def __init__(self, torch_device: torch.device, tracer: Tracer | NoTracer = NO_TRACER
                 ) -> None:
        self.torch_device = torch_device
        self.tracer = tracer
        self._compute_s = 0.0

    # -- copies and ordering ----

    def copy(self, dst: torch.Tensor, src: torch.Tensor, link: Link, what: str = "", *,
             after: Sequence[Any] | None = AFTER_COMPUTE) -> Any:
        """Copy `src` into `dst` over `link` (H2D or D2H); returns the copy's event (None: it
        is done). `after`: the events the copy waits for (AFTER_COMPUTE: all compute queued so
        far). Compute must `wait` for the event before reading `dst`, the host `wait_host`
        before reading a host `dst` or reusing a host `src`."""
        with self.tracer.span(LINK_LANE[link], what or LINK_LANE[link], cat="transfer",
                              bytes=nbytes_of(src)):
            dst.copy_(src)
        return None

    def mark(self) -> Any:
        """An event after the compute queued so far (e.g. the last read of a slot)."""
        return None

    def wait(self, event: Any, what: str = "") -> None:
        """Compute's next work starts after `event`; the host does not block."""

    def wait_host(self, event: Any, what: str = "") -> None:
        """The calling thread blocks until `event` has happened."""

    def synchronize(self) -> None:
        """The host waits for everything queued on the device (between steps only)."""

    def copies_done(self) -> Any:
        """Something whose `query()` is True once every copy queued so far has finished (None:
        they have): a pinned range freed now is reused only after it (tierlm.memory.arena)."""
        return None

    def read(self, t: torch.Tensor) -> list[float]:
        """The values of device tensor `t` on the host: a host synchronisation. A step makes
        exactly one, for the global gradient norm (Engine._finish_step says why it is safe)."""
        return t.detach().flatten().tolist()

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A batch's host tensor on the device, ordered before the compute issued next."""
        return t.to(self.torch_device)

    # -- work the time model counts ----

    @contextlib.contextmanager
    def compute(self, name: str = "compute", flops: float = 0.0, *, block: bool = False
                ) -> Iterator[None]:
        """A region of compute (`flops` of it; `block`: a transformer block's matmuls, which
        run on fp8 units in an fp8 run). Its time counts in `take_compute_s`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._compute_s += t1 - t0
            self.tracer.record("compute", "compute", t0, t1, cat="compute")

    def take_compute_s(self) -> float:
        """Seconds of compute since the previous call (after the step's own sync)."""
        s, self._compute_s = self._compute_s, 0.0
        return s

    def cpu_work(self, name: str, *, moved_bytes: int = 0, params: float = 0.0
            ) -> contextlib.AbstractContextManager[None]:
        """CPU work on the calling thread, priced by the time model as `moved_bytes` through
        memory (a landed gradient's add) plus `params` of AdamW-equivalent update work; only
        the simulated device uses the price."""
        return contextlib.nullcontext()

    def net(self, link: Link, nbytes: int, name: str) -> contextlib.AbstractContextManager[None]:
        """A transfer of `nbytes` of payload to (`Link.NET_SEND`) or from (`Link.NET_RECV`) the
        memory node, made by the calling thread inside this context (tierlm.node's client
        blocks until it is done); priced by the time model on the network lane of that
        direction; only the simulated device uses the price."""
        return contextlib.nullcontext()

    def node_work(self, name: str, *, params: float) -> contextlib.AbstractContextManager[None]:
        """The memory node's optimizer update of `params` parameters (AdamW-equivalent work,
        as `cpu_work` prices it), which the calling thread waits for inside this context;
        priced on the node's CPU lane; only the simulated device uses the price."""
        return contextlib.nullcontext()

    def io(self, fut: Future, link: Link, nbytes: int, what: str = "") -> Future:
        """A disk request the store just started (its future); the simulated device books it
        on the drive's lane."""
        return fut

    def worker(self, name: str, *, overlaps_device: bool = False) -> Executor:
        """The executor of a background thread of the step (the update worker, the
        write-back, the gradient landing). `overlaps_device`: the thread exists only to keep
        the device busy meanwhile (the landing); where the device is this CPU, its tasks run
        when submitted, on the calling thread."""
        if overlaps_device and not self.asynchronous:
            return _Immediate()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierlm-{name}")

    # -- per step ----

    def begin_step(self) -> Any:
        """Called as a step starts; `end_step` takes what it returns."""
        return None

    def end_step(self, begun: Any) -> dict[str, float]:
        """What the device itself measured of the step (the simulated device: its virtual
        step time and the busy time of each lane)."""
        return {}

    def take_link_s(self) -> dict[Link, float]:
        """Seconds per link of the asynchronous copies finished since the previous call, timed
        on the device (empty where `copy` returns done and the store times it)."""
        return {}

    def take_wait_s(self) -> float:
        """Seconds the compute stream stood still in `wait` since the previous call, timed on
        the device (0 where a wait cannot stall the device without the host: on this CPU a
        copy is done when issued, and the engine's host timers count what the host waits)."""
        return 0.0


class HostDevice(Device):
    pass


class CudaDevice(Device):
    kind = "cuda"
    asynchronous = True

    def __init__(self, torch_device: torch.device, tracer: Tracer | NoTracer = NO_TRACER
                 ) -> None:
        super().__init__(torch_device, tracer)
        self.streams = {Link.H2D: torch.cuda.Stream(torch_device),
                        Link.D2H: torch.cuda.Stream(torch_device)}
        self._regions: list[tuple[Any, Any]] = []
        self._copies: list[tuple[Link, int, Any, Any]] = []  # timed, read at the step's end
        self._waits: list[tuple[Any, Any]] = []  # compute's device-side waits, timed

    def _current(self):
        return torch.cuda.current_stream(self.torch_device)

    def copy(self, dst, src, link, what="", *, after=AFTER_COMPUTE):
        stream = self.streams[link]
        if after is AFTER_COMPUTE:
            stream.wait_stream(self._current())
        else:
            for event in after:
                if event is not None:
                    stream.wait_event(event)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            with self.tracer.span(LINK_LANE[link], what or LINK_LANE[link], cat="transfer",
                                  stream=stream, bytes=nbytes_of(src)):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
        # device memory used on a side stream is not handed out again before the copy ends
        for t in (dst, src):
            if t.device.type == "cuda":
                t.record_stream(stream)
        self._copies.append((link, nbytes_of(src), start, end))
        return end

    def mark(self):
        event = torch.cuda.Event()
        event.record(self._current())
        return event

    def wait(self, event, what=""):
        if event is not None:
            # timed by events on either side: the second passes only once `event` has, so
            # their interval is the stall (the host never waits for it: take_wait_s)
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            stream = self._current()
            before.record(stream)
            stream.wait_event(event)
            after.record(stream)
            self._waits.append((before, after))

    def wait_host(self, event, what=""):
        if event is not None:
            event.synchronize()

    def synchronize(self):
        torch.cuda.synchronize(self.torch_device)

    def copies_done(self):
        return _AllDone([self._record(stream) for stream in self.streams.values()])

    @staticmethod
    def _record(stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def upload(self, t):
        if t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(self.torch_device, non_blocking=True)

    @contextlib.contextmanager
    def compute(self, name="compute", flops=0.0, *, block=False):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(self._current())
        try:
            with self.tracer.span("compute", "compute", cat="compute", stream=self._current()):
                yield
        finally:
            end.record(self._current())
            self._regions.append((start, end))

    def take_compute_s(self) -> float:
        regions, self._regions = self._regions, []
        if regions:
            regions[-1][1].synchronize()  # the stream ran the regions in order
        return sum(a.elapsed_time(b) for a, b in regions) / 1000  # ms -> s

    def take_link_s(self) -> dict[Link, float]:
        """Seconds per link of the copies that have finished since the previous call, timed by
        their own events (the others are kept for a later call: nothing waits here)."""
        out: dict[Link, float] = {}
        pending = []
        for link, nbytes, start, end in self._copies:
            if end.query():
                out[link] = out.get(link, 0.0) + start.elapsed_time(end) / 1000  # ms -> s
            else:
                pending.append((link, nbytes, start, end))
        self._copies = pending
        return out

    def take_wait_s(self) -> float:
        """The device-side waits that have passed since the previous call (the others are kept
        for a later call: nothing waits here)."""
        total, pending = 0.0, []
        for before, after in self._waits:
            if after.query():
                total += before.elapsed_time(after) / 1000  # ms -> s
            else:
                pending.append((before, after))
        self._waits = pending
        return total


class _AllDone:
    """Events that have all passed."""

    def __init__(self, events: list) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)


def _poison(t: torch.Tensor) -> None:
    """What a destination holds until its copy lands: NaN, or all bits set for integers."""
    if t.dtype.is_floating_point:
        t.fill_(math.nan)
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.uint8:
        t.fill_(255)  # as bf16, fp16, fp32 or fp8 bytes: NaN
    else:
        t.fill_(-1)


class _Immediate(Executor):
    """An executor that runs each task when it is submitted, on the calling thread."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # re-raised where the result is taken, as a thread's
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _Done(Future):
    """A future the simulated device finished inline: it is done in virtual time at `t_s`, and
    its result may be taken only after the host has waited until then."""

    def __init__(self, timeline: Timeline, t_s: float, what: str) -> None:
        super().__init__()
        self.timeline, self.t_s, self.what = timeline, t_s, what

    def done(self) -> bool:
        return self.t_s <= self.timeline.host.t_s

    def result(self, timeout: float | None = None):
        self.timeline.wait_host(self.t_s, self.what, "update wait")
        return super().result(timeout)


class _InlineWorker(Executor):
    """The simulated device's background thread: each task runs when submitted, on a host
    clock of its own that starts no earlier than the submitter's now."""

    def __init__(self, timeline: Timeline, lane: str) -> None:
        self.timeline, self.lane = timeline, lane
        self.clock = HostClock(lane)

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        with self.timeline.thread(self.lane, self.clock):
            try:
                value, error = fn(*args, **kwargs), None
            except BaseException as e:  # re-raised where the result is taken, as a thread's
                value, error = None, e
        fut = _Done(self.timeline, self.clock.t_s, self.lane)
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _TimedIO(Future):
    """A disk request's future whose result the host may take only once the drive's lane has
    served it in virtual time."""

    def __init__(self, fut: Future, timeline: Timeline, t_s: float, what: str) -> None:
        super().__init__()
        self.fut, self.timeline, self.t_s, self.what = fut, timeline, t_s, what

    def done(self) -> bool:
        return self.fut.done() and self.t_s <= self.timeline.host.t_s

    def add_done_callback(self, fn) -> None:
        self.fut.add_done_callback(lambda _f: fn(self))

    def result(self, timeout: float | None = None):
        self.timeline.wait_host(self.t_s, self.what, "disk wait")
        return self.fut.result(timeout)

    def exception(self, timeout: float | None = None):
        return self.fut.exception(timeout)


class TimingDevice(Device):
    """A GPU's timing without tensors: every copy, wait, compute region, disk request, CPU
    price and worker books on a `Timeline` at the profile's rates and touches no memory. The
    planner's replay (tierlm.plan.replay.simulate_step) runs the step over byte counts on
    one, so its timeline is the one `SimDevice` gives the engine's real tensors."""

    kind = "timing"
    asynchronous = True

    def __init__(self, profile: HardwareProfile, precision: str = "bf16", *, tf32: bool = False,
                 tracer: Tracer | NoTracer = NO_TRACER) -> None:
        super().__init__(torch.device("cpu"), tracer)
        self.profile = profile
        self.timeline = Timeline(Rates.of(profile, precision, tf32=tf32))
        self._compute_mark = 0.0  # busy seconds of the compute lane at the last take

    def _deps(self, after) -> list:
        """The events a copy waits for (AFTER_COMPUTE: the compute queued so far)."""
        if after is AFTER_COMPUTE:
            return [self.timeline.mark()]
        return [e for e in after if e is not None]

    def copy(self, dst, src, link, what="", *, after=AFTER_COMPUTE):
        return self.timeline.copy(link, nbytes_of(src), what or LINK_LANE[link],
                                  self._deps(after))

    def mark(self):
        return self.timeline.mark(COMPUTE)

    def wait(self, event, what=""):
        self.timeline.wait(event, COMPUTE, what)

    def wait_host(self, event, what=""):
        if event is not None:
            self.timeline.wait_host(event.t_s, what, "transfer wait")

    def synchronize(self):
        self.timeline.synchronize()

    def read(self, t):
        self.timeline.wait_host(self.timeline.compute.t_s, "read", "sync")
        return [0.0] * t.numel()

    def upload(self, t):
        return t

    @contextlib.contextmanager
    def compute(self, name="compute", flops=0.0, *, block=False):
        yield
        self.timeline.compute_op(name, flops, block=block)

    def take_compute_s(self) -> float:
        busy = self.timeline.lane(COMPUTE).busy_s
        s, self._compute_mark = busy - self._compute_mark, busy
        return s

    @contextlib.contextmanager
    def cpu_work(self, name, *, moved_bytes=0, params=0.0):
        yield
        rates = self.timeline.rates
        self.timeline.cpu(moved_bytes / rates.host_copy_Bps
                          + params / rates.cpu_adam_params_per_s, name)

    @contextlib.contextmanager
    def net(self, link, nbytes, name):
        # the client blocks until the payload has crossed: the calling thread's clock waits
        # for the link's lane of that direction
        yield
        self.timeline.blocking(LINK_LANE[link], self.timeline.rates.link_s(link, nbytes), name,
                               "network", bytes=nbytes, link=link.value)

    @contextlib.contextmanager
    def node_work(self, name, *, params):
        yield
        self.timeline.blocking(NODE_CPU, self.timeline.rates.node_s(params), name, "node")

    def io(self, fut, link, nbytes, what=""):
        return _TimedIO(fut, self.timeline, self.timeline.disk(link, nbytes, what), what)

    def worker(self, name, *, overlaps_device=False):
        return _InlineWorker(self.timeline, f"cpu {name}")

    def begin_step(self):
        tl = self.timeline
        # nothing is booked before the host's now any more: earlier intervals and the last
        # step's operations go
        for lane in tl.lanes.values():
            lane.forget_before(tl.host.t_s)
        tl.ops = []
        return tl.host.t_s, {n: lane.busy_s for n, lane in tl.lanes.items()}, tl.wait_s

    def end_step(self, begun):
        t0, busy, wait_s = begun
        tl = self.timeline
        self.step_window_s = (t0, tl.host.t_s)
        self.step_ops = list(tl.ops)

        def lane_s(name: str) -> float:
            lane = tl.lanes.get(name)
            return 0.0 if lane is None else lane.busy_s - busy.get(name, 0.0)

        node = {} if tl.rates.net_Bps is None else {  # with a memory node only
            "sim_net_send_s": lane_s(NET_SEND), "sim_net_recv_s": lane_s(NET_RECV),
            "sim_node_cpu_s": lane_s(NODE_CPU)}
        return {
            "sim_step_s": tl.host.t_s - t0,  # from this step's start to the next one's
            "sim_compute_s": lane_s(COMPUTE),
            "sim_h2d_s": lane_s(H2D),
            "sim_d2h_s": lane_s(D2H),
            "sim_disk_s": lane_s(DISK),
            "sim_cpu_update_s": lane_s("cpu update"),
            # the gradient adds: on the training thread, or on the landing worker's lane
            "sim_cpu_s": lane_s("cpu") + lane_s("cpu landing"),
            "sim_transfer_wait_s": tl.wait_s - wait_s,  # compute idle, waiting for copies
            **node,
        }


class WriteAfterRead(RuntimeError):
    """An upload on the simulated device would overwrite bytes that compute queued before it
    still reads: on a GPU that compute would read the new bytes (or half of them)."""


def _extent(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage, first byte, end byte) that `t` spans; None for a tensor without storage."""
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if t.numel() == 0:
        return None
    size = t.element_size()
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    first = t.storage_offset() * size
    return base, first, first + span * size


class _Reads(TorchDispatchMode):
    """Records the byte extent of every tensor an operation takes, inside a compute region."""

    def __init__(self) -> None:
        super().__init__()
        self.extents: set[tuple[int, int, int]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs or {}).values()):
            for t in (a if isinstance(a, list | tuple) else (a,)):
                if isinstance(t, torch.Tensor):
                    extent = _extent(t)
                    if extent is not None:
                        self.extents.add(extent)
        return func(*args, **(kwargs or {}))


class SimDevice(TimingDevice):
    """CPU tensors, a GPU's timing (see the module's docstring)."""

    kind = "sim"

    def __init__(self, profile: HardwareProfile, precision: str = "bf16", *, tf32: bool = False,
                 tracer: Tracer | NoTracer = NO_TRACER) -> None:
        super().__init__(profile, precision, tf32=tf32, tracer=tracer)
        # per stream: copies issued and not yet landed, in order: (seq, dst, src, events waited)
        self._pending: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, list]]] = {
            H2D: [], D2H: []}
        # per storage: (first byte, end byte) -> when the last compute reading them ends,
        # and that compute's name
        self._read_until: dict[int, dict[tuple[int, int], tuple[float, str]]] = {}

    @contextlib.contextmanager
    def compute(self, name="compute", flops=0.0, *, block=False):
        reads = _Reads()
        with reads:
            yield
        end = self.timeline.compute_op(name, flops, block=block).t_s
        for base, first, last in reads.extents:
            self._read_until.setdefault(base, {})[(first, last)] = (end, name)

    def copy(self, dst, src, link, what="", *, after=AFTER_COMPUTE):
        deps = self._deps(after)
        what = what or LINK_LANE[link]
        event = self.timeline.copy(link, nbytes_of(src), what, deps)
        if link == Link.H2D:
            self._check_write_after_read(dst, event.t_s - self.timeline.rates.link_s(
                link, nbytes_of(src)), what)
        _poison(dst)
        self._pending[event.stream.name].append((event.seq, dst, src, deps))
        return event

    def begin_step(self):
        # a copy issued from now on starts no earlier than the host's now: reads that end by
        # then can never race with it
        now = self.timeline.host.t_s
        for base in list(self._read_until):
            reads = self._read_until[base]
            for key in [key for key, (end_s, _) in reads.items() if end_s <= now]:
                del reads[key]
            if not reads:
                del self._read_until[base]
        return super().begin_step()

    def _check_write_after_read(self, dst: torch.Tensor, start_s: float, what: str) -> None:
        extent = _extent(dst)
        if extent is None:
            return
        base, first, last = extent
        reads = self._read_until.get(base, {})
        for (lo, hi), (end_s, name) in list(reads.items()):
            if lo < last and first < hi:
                if end_s > start_s + 1e-12:
                    raise WriteAfterRead(
                        f"simulated device: the upload {what!r} starts at {start_s:.6f} s into "
                        f"bytes {name!r} reads until {end_s:.6f} s: the copy must wait for "
                        f"that compute (copy(after=...) with its event)")
                del reads[(lo, hi)]  # this upload replaces what was read

    def _land(self, event) -> None:
        """Every copy on `event`'s stream up to it lands, in issue order, each after the
        copies it waited for."""
        if event is None or event.stream.name not in self._pending:
            return
        queue = self._pending[event.stream.name]
        while queue and queue[0][0] <= event.seq:
            _, dst, src, deps = queue.pop(0)
            for dep in deps:
                self._land(dep)
            dst.copy_(src)

    def wait(self, event, what=""):
        self._land(event)
        super().wait(event, what)

    def wait_host(self, event, what=""):
        self._land(event)
        super().wait_host(event, what)

    def synchronize(self):
        self._land_all()
        super().synchronize()

    def _land_all(self) -> None:
        for name in self._pending:
            self._land(self.timeline.mark(name))

    def copies_done(self):
        # a pinned range freed now may be cut again at once: what the copies queued so far
        # read and write lands first (on a GPU the arena waits for them)
        self._land_all()
        return None

    def read(self, t):
        self.timeline.wait_host(self.timeline.compute.t_s, "read", "sync")
        return Device.read(self, t)


def sim_profile(name: str) -> HardwareProfile | None:
    """The profile `--device sim:NAME` names (None: not a simulated device)."""
    if not name.startswith(SIM_PREFIX):
        return None
    key = name[len(SIM_PREFIX):]
    if key not in PROFILES:
        raise ValueError(f"--device {name}: no hardware profile {key!r}; one of "
                         f"{', '.join('sim:' + p for p in sorted(PROFILES))}")
    return PROFILES[key]


def as_device(device: torch.device | Device, tracer: Tracer | NoTracer = NO_TRACER) -> Device:
    """`device` as a Device (a torch.device: the host's or CUDA's)."""
    if isinstance(device, Device):
        return device
    return CudaDevice(device, tracer) if device.type == "cuda" else HostDevice(device, tracer)


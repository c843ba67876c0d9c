"""A timeline of one training step, written as a Chrome/Perfetto trace (`trace.json`).

`Tracer` collects events (lane, name, start, end) from every thread the step uses: the training
thread's actions and waits, the store's copies, the disk tier's I/O threads and the update
worker. It records only while armed (the trainer arms it for `--monitor.trace_step N`); the
runtime gets it at setup and calls it unconditionally. A run without tracing holds `NO_TRACER`,
whose calls return a shared no-op.

Times are `time.perf_counter()` seconds on the host. Copies issued on a CUDA side stream are
timed by CUDA events on that stream instead (`span(..., stream=s)`), resolved to the host clock
when the tracer is disarmed, after the step has been synchronised; compute stays on the host
clock, the clock `compute_s` is measured with.

Lanes never overlap by construction: `chrome_trace` splits each lane into as many rows (Chrome
"threads") as it needs, greedily, so events in one row are disjoint in integer nanoseconds: four
disk requests in flight at once become rows "disk read", "disk read 2", ...
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# lanes in the order they are drawn (others follow, alphabetically)
LANES = ("step", "compute", "wait", "H2D", "D2H", "disk read", "disk write", "disk", "cpu",
         "cpu landing", "cpu update", "device update")
MEASURED_PID = 1
PREDICTED_PID = 2


@dataclass
class TraceEvent:
    lane: str
    name: str
    cat: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)


class _Null:
    """The span of a tracer that is off or not armed."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self, start_s: float, end_s: float) -> None:
        return None


_NULL = _Null()


class NoTracer:
    """Tracing off: every call is a no-op."""

    armed = False

    def span(self, lane: str, name: str, *, cat: str = "", stream: Any = None, **args: Any):
        return _NULL

    def open(self, lane: str, name: str, *, cat: str = "", **args: Any):
        return _NULL

    def record(self, lane: str, name: str, start_s: float, end_s: float, *, cat: str = "",
               **args: Any) -> None:
        return None


NO_TRACER = NoTracer()


class _Span:
    def __init__(self, tracer: Tracer, lane: str, name: str, cat: str,
                 args: dict[str, Any]) -> None:
        self.tracer, self.lane, self.name, self.cat, self.args = tracer, lane, name, cat, args

    def __enter__(self) -> None:
        self.start_s = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.close(self.start_s, time.perf_counter())

    def close(self, start_s: float, end_s: float) -> None:
        self.tracer._add(TraceEvent(self.lane, self.name, self.cat, start_s, end_s, self.args))


class _CudaSpan(_Span):
    """Timed by CUDA events recorded on `stream` around the work issued inside it."""

    def __init__(self, tracer: Tracer, lane: str, name: str, cat: str, args: dict[str, Any],
                 stream: Any) -> None:
        super().__init__(tracer, lane, name, cat, args)
        self.stream = stream

    def __enter__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def __exit__(self, *exc: object) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        with self.tracer._lock:
            self.tracer._cuda.append((self, self.start, end))


class Tracer:
    """Records while armed (`arm` ... `disarm`); see the module docstring."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._armed = False
        self._lock = threading.Lock()
        self._events: list[TraceEvent] = []
        self._cuda: list[tuple[_CudaSpan, Any, Any]] = []
        self._ref: Any = None  # a CUDA event at the host time `_ref_s`
        self._ref_s = 0.0
        self.origin_s = 0.0

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        with self._lock:
            self._events, self._cuda = [], []
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(self.device))
            self._ref.synchronize()
            self._ref_s = time.perf_counter()
        self.origin_s = time.perf_counter()
        self._armed = True

    def disarm(self) -> list[TraceEvent]:
        """Stop recording; the events so far, CUDA ones resolved (call after the step's work
        has finished: the trainer synchronises the runtime first)."""
        self._armed = False
        with self._lock:
            events, cuda = list(self._events), list(self._cuda)
            self._events, self._cuda = [], []
        for span, start, end in cuda:
            end.synchronize()
            events.append(TraceEvent(
                span.lane, span.name, span.cat,
                self._ref_s + self._ref.elapsed_time(start) / 1e3,
                self._ref_s + self._ref.elapsed_time(end) / 1e3, span.args,
            ))
        events.sort(key=lambda e: (e.start_s, e.end_s))
        return events

    def span(self, lane: str, name: str, *, cat: str = "", stream: Any = None, **args: Any):
        """A context manager timing the work inside it (on `stream`'s CUDA events if given)."""
        if not self._armed:
            return _NULL
        if stream is not None:
            return _CudaSpan(self, lane, name, cat, args, stream)
        return _Span(self, lane, name, cat, args)

    def open(self, lane: str, name: str, *, cat: str = "", **args: Any):
        """An event decided now and timed later by `.close(start_s, end_s)` (disk requests:
        submitted in the training thread, timed in the I/O threads)."""
        if not self._armed:
            return _NULL
        return _Span(self, lane, name, cat, args)

    def record(self, lane: str, name: str, start_s: float, end_s: float, *, cat: str = "",
               **args: Any) -> None:
        if self._armed:
            self._add(TraceEvent(lane, name, cat, start_s, end_s, args))

    def _add(self, event: TraceEvent) -> None:
        with self._lock:
            self._events.append(event)


# -- Chrome trace event format ---------------------------------------------------------------


def _lane_key(lane: str) -> tuple[int, str]:
    return (LANES.index(lane) if lane in LANES else len(LANES), lane)


def assign_rows(events: list[TraceEvent], origin_s: float) -> list[tuple[str, int, int,
                                                                         TraceEvent]]:
    """(row name, start ns, end ns, event) for every event: each lane split greedily into rows
    whose events are disjoint in integer nanoseconds since `origin_s`."""
    out = []
    lanes: dict[str, list[TraceEvent]] = {}
    for e in events:
        lanes.setdefault(e.lane, []).append(e)
    for lane in sorted(lanes, key=_lane_key):
        ends: list[int] = []  # per row, the end of its last event
        timed = sorted(
            ((round((e.start_s - origin_s) * 1e9), round((e.end_s - origin_s) * 1e9), e)
             for e in lanes[lane]), key=lambda t: (t[0], t[1]),
        )
        for start, end, e in timed:
            end = max(start, end)
            row = next((i for i, last in enumerate(ends) if last <= start), len(ends))
            if row == len(ends):
                ends.append(end)
            else:
                ends[row] = end
            out.append((lane if row == 0 else f"{lane} {row + 1}", start, end, e))
    return out


def chrome_events(events: list[TraceEvent], *, pid: int, process: str,
                  origin_s: float) -> list[dict[str, Any]]:
    """Complete ("X") events of one process, one Chrome thread per row, with the metadata
    ("M") events naming the process and its rows."""
    rows = assign_rows(events, origin_s)
    tids: dict[str, int] = {}
    for name, _, _, _ in rows:
        tids.setdefault(name, len(tids) + 1)
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
         "args": {"sort_index": pid}},
    ]
    for name, tid in tids.items():
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"name": name}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid}})
    for name, start, end, e in rows:
        out.append({"name": e.name, "cat": e.cat or e.lane, "ph": "X", "ts": start / 1e3,
                    "dur": (end - start) / 1e3, "pid": pid, "tid": tids[name],
                    "args": {"lane": e.lane, **e.args}})
    return out


def chrome_trace(measured: list[TraceEvent], origin_s: float,
                 predicted: list[TraceEvent] = (), **other: Any) -> dict[str, Any]:
    """The JSON object Perfetto and chrome://tracing open: measured events under one process,
    the planner's predicted ones (times from 0) under another; `other` goes to `otherData`."""
    events = chrome_events(measured, pid=MEASURED_PID, process="measured", origin_s=origin_s)
    if predicted:
        events += chrome_events(list(predicted), pid=PREDICTED_PID, process="predicted",
                                origin_s=0.0)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}

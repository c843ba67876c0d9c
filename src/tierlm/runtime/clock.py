"""Time the step spends computing, measured around the compute itself.

The step-time split (compute, transfer wait, update wait) needs compute measured on its own:
defined as what is left of the step after the waits, it would absorb data loading, copies started
without waiting, disk writes and bookkeeping, and the parts would add up whatever happened. A
stepper wraps its forward, backward and on-device update work in `measure()` and reports
`take()` once per step. On CPU that is the wall time inside the regions. On CUDA a kernel runs
after its launch returns, so the clock records events on the current stream around each region
and sums their elapsed times when the step is over. Each region is also a span on the trace's
`compute` lane (tierlm.monitor.trace), so that lane is exactly what `compute_s` counts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

import torch

from tierlm.monitor.trace import NO_TRACER, NoTracer, Tracer


class ComputeClock(Protocol):
    def measure(self) -> contextlib.AbstractContextManager[None]: ...

    def take(self) -> float:
        """Seconds measured since the previous call."""
        ...


class WallClock:
    def __init__(self, tracer: Tracer | NoTracer = NO_TRACER) -> None:
        self._s = 0.0
        self.tracer = tracer

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._s += t1 - t0
            self.tracer.record("compute", "compute", t0, t1, cat="compute")

    def take(self) -> float:
        s, self._s = self._s, 0.0
        return s


class CudaEventClock:
    def __init__(self, tracer: Tracer | NoTracer = NO_TRACER) -> None:
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.tracer = tracer

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            with self.tracer.span("compute", "compute", cat="compute",
                                  stream=torch.cuda.current_stream()):
                yield
        finally:
            end.record()
            self._events.append((start, end))

    def take(self) -> float:
        events, self._events = self._events, []
        if events:
            events[-1][1].synchronize()  # the stream ran the regions in order
        return sum(a.elapsed_time(b) for a, b in events) / 1000  # ms -> s


def compute_clock(
    device: torch.device, tracer: Tracer | NoTracer = NO_TRACER
) -> ComputeClock:
    return CudaEventClock(tracer) if device.type == "cuda" else WallClock(tracer)

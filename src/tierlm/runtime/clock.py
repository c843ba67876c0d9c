"""Time the step spends computing, measured around the compute itself.

The step-time split (compute, transfer wait, update wait) needs compute measured on its own:
defined as what is left of the step after the waits, it would absorb data loading, copies started
without waiting, disk writes and bookkeeping, and the parts would add up whatever happened. A
stepper wraps its forward, backward and on-device update work in `measure()` and reports
`take()` once per step. The device measures (tierlm.memory.device): the wall time inside the
regions on a CPU, CUDA events around them on a GPU (a kernel runs after its launch returns), the
virtual time of the compute lane on a simulated device, which also prices each region by the
FLOPs it is given. Each region is a span on the trace's `compute` lane (tierlm.trace),
so that lane is exactly what `compute_s` counts.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from tierlm.memory.device import Device, as_device
from tierlm.trace import NO_TRACER, NoTracer, Tracer


class ComputeClock(Protocol):
    def measure(self, name: str = "compute", flops: float = 0.0, *, block: bool = False
                ) -> contextlib.AbstractContextManager[None]: ...

    def take(self) -> float:
        """Seconds measured since the previous call."""
        ...


class DeviceClock:
    """The compute regions of one device."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def measure(self, name: str = "compute", flops: float = 0.0, *, block: bool = False
                ) -> contextlib.AbstractContextManager[None]:
        return self.device.compute(name, flops, block=block)

    def take(self) -> float:
        return self.device.take_compute_s()


def compute_clock(
    device: torch.device | Device, tracer: Tracer | NoTracer = NO_TRACER
) -> ComputeClock:
    return DeviceClock(as_device(device, tracer))

"""Alerts: silent failures made loud. Each detector reads the step records the monitor builds
(metrics.jsonl's fields) and returns a message when its condition starts; the monitor logs the
message, counts it, and lists the alert's name in the step's `alerts` field.

- `loss_spike`: the loss variance over the last 10 steps exceeds 10x the mean of that variance
  over the trailing 100 steps (`LossSpikeDetector`, also used by the reliability features).
- `non_finite`: a step whose loss or gradient norm is inf/NaN (the step was skipped).
- `thrashing`: a segment fetched to the device more times in a step than the schedule plans
  (the plan is a dry run of the stream cache's own policy over the step's access sequence).
- `disk_slow`: disk-tier throughput over the last few steps far below a reference: the lower of
  a probe of the same directory with the run's request size and the run's own first few steps
  (a run whose I/O shares the cores with its compute is slower than the probe from its start;
  the alert is for a disk that slows down, not for that).
- `disk_wear`: the disk tier's writes would use more than 1% of the drive's rated endurance
  (`--disk-endurance-tbw`) per day of training.
- `gpu_throttle`: NVML reports the GPU slowing its clocks for heat or power.

Conditions that persist (a noisy stretch, a throttled GPU) alert once when they start, not on
every step; each non-finite step alerts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from tierlm.memory.device import HostDevice
from tierlm.memory.tiers import Tier
from tierlm.memory.wear import DiskWear
from tierlm.runtime.cache import StreamCache


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _var(xs: Iterable[float]) -> float:
    xs = list(xs)
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


class LossSpikeDetector:
    """The loss-spike rule: `update(loss)` returns True on the step where the variance of the
    last `window` losses first exceeds `factor` x the mean of that windowed variance over the
    trailing `history` steps.

    The trailing mean needs `window` earlier variances (so the first verdict comes at step
    2 * window); non-finite losses are ignored here (they are their own alert). True is
    returned once per spike: the detector re-arms when the variance falls back under the bar.
    """

    def __init__(self, window: int = 10, history: int = 100, factor: float = 10.0) -> None:
        self.window, self.history, self.factor = window, history, factor
        self.reset()

    def reset(self) -> None:
        self.losses: deque[float] = deque(maxlen=self.window)
        self.variances: deque[float] = deque(maxlen=self.history)
        self.window_var: float | None = None  # the latest windowed variance
        self.baseline_var: float | None = None  # the trailing mean it was compared with
        self.spiking = False

    def update(self, loss: float) -> bool:
        if not _finite(loss):
            return False
        self.losses.append(float(loss))
        if len(self.losses) < self.window:
            return False
        var = _var(self.losses)
        self.window_var = var
        self.baseline_var = (
            sum(self.variances) / len(self.variances)
            if len(self.variances) >= self.window
            else None
        )
        self.variances.append(var)
        over = self.baseline_var is not None and var > self.factor * self.baseline_var
        fired = over and not self.spiking
        self.spiking = over
        return fired


class Alert(Protocol):
    name: str

    def check(self, rec: dict[str, Any]) -> str | None:
        """A message if this step starts the condition, else None."""
        ...


class LossSpike:
    name = "loss_spike"

    def __init__(self, detector: LossSpikeDetector | None = None) -> None:
        self.detector = detector or LossSpikeDetector()

    def check(self, rec: dict[str, Any]) -> str | None:
        d = self.detector
        if not d.update(rec["loss"]):
            return None
        return (
            f"loss spike: variance of the last {d.window} losses {d.window_var:.3g} is "
            f"{d.window_var / d.baseline_var:.0f}x its trailing mean {d.baseline_var:.3g}"
        )


class NonFinite:
    name = "non_finite"

    def check(self, rec: dict[str, Any]) -> str | None:
        if rec.get("skipped") or not _finite(rec["loss"]) or not _finite(rec["grad_norm"]):
            return (
                f"non-finite step (loss {rec['loss']}, gradient norm {rec['grad_norm']}): "
                f"skipped, weights and optimizer state untouched "
                f"({rec.get('skipped_steps', '?')} skipped so far)"
            )
        return None


class Thrashing:
    """Reads `segments_over_plan` ({segment: [fetched, planned]}) from the record."""

    name = "thrashing"

    def check(self, rec: dict[str, Any]) -> str | None:
        over = rec.get("segments_over_plan")
        if not over:
            return None
        worst = sorted(over.items(), key=lambda kv: kv[1][0] - kv[1][1], reverse=True)
        shown = ", ".join(f"{name} {got}x (plan {plan}x)" for name, (got, plan) in worst[:4])
        more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
        return (
            f"thrashing: segments fetched more often than the schedule plans: {shown}{more}; "
            "raise --device-budget or keep fewer segments resident"
        )


class DiskSlow:
    """Disk-tier throughput (bytes / summed request time, as the ledger reports it) over the last
    `window` steps below `ratio` x a baseline, per direction. The baseline is the lower of the
    reference measured at setup and the run's first full window: the probe runs alone, while the
    run's requests share the cores with its compute and are slower from the first step on a
    small machine, which is the machine and not a disk gone slow."""

    name = "disk_slow"

    def __init__(
        self, reference_Bps: dict[str, float], *, ratio: float = 0.2, window: int = 5
    ) -> None:
        self.reference_Bps = reference_Bps  # "disk_read" / "disk_write" -> bytes/s
        self.ratio = ratio
        self.window = window
        self.moved: dict[str, deque[tuple[float, float]]] = {
            link: deque(maxlen=window) for link in reference_Bps
        }
        self.baseline_Bps: dict[str, float] = {}  # per link, set by its first full window
        self.slow = False

    def check(self, rec: dict[str, Any]) -> str | None:
        slow = []
        for link, ref in self.reference_Bps.items():
            nbytes, rate = rec.get(f"{link}_bytes"), rec.get(f"{link}_Bps")
            if nbytes and rate:
                self.moved[link].append((nbytes, nbytes / rate))
            q = self.moved[link]
            if len(q) < self.window:
                continue
            rate = sum(b for b, _ in q) / sum(s for _, s in q)
            base = self.baseline_Bps.setdefault(link, min(ref, rate))
            if rate < self.ratio * base:
                name = link.replace("_", " ")
                slow.append(f"{name} {rate / 1e6:.0f} MB/s vs {base / 1e6:.0f}")
        fired = bool(slow) and not self.slow
        self.slow = bool(slow)
        if not fired:
            return None
        return (
            f"disk slow: {', '.join(slow)} MB/s (the lower of the probe of the offload directory "
            f"at setup and the run's first {self.window} steps; last {self.window} steps); "
            "is the disk shared, full or throttling?"
        )


class DiskWearAlert:
    """The disk tier's writes, projected to a day of training against the drive's rated
    endurance (`tierlm.memory.wear`): alerts once, after `warmup` steps that wrote, when a day
    would use more than the warning share. `summary()` is the run's measured projection."""

    name = "disk_wear"

    def __init__(self, endurance_tbw: float, *, warmup: int = 3) -> None:
        self.endurance_tbw = endurance_tbw
        self.warmup = warmup
        self.written_bytes = 0.0
        self.seconds = 0.0
        self.steps = 0
        self.fired = False

    def wear(self) -> DiskWear | None:
        if not self.steps:
            return None
        return DiskWear(write_bytes_per_step=self.written_bytes / self.steps,
                        step_s=self.seconds / self.steps, endurance_tbw=self.endurance_tbw)

    def check(self, rec: dict[str, Any]) -> str | None:
        nbytes, step_s = rec.get("disk_write_bytes"), rec.get("step_time_s")
        if not nbytes or not _finite(step_s):
            return None
        self.written_bytes += nbytes
        self.seconds += step_s
        self.steps += 1
        wear = self.wear()
        if self.fired or self.steps < self.warmup or not wear.too_high:
            return None
        self.fired = True
        return f"{wear.describe()}. {wear.warning()}"

    def summary(self) -> str | None:
        wear = self.wear()
        return None if wear is None else f"measured over {self.steps} steps: {wear.describe()}"


# NVML clock-event reasons that mean the GPU is slowing itself down (idle, application clock
# settings and sync boost are not).
THROTTLING = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
     "hw_power_brake_slowdown"}
)


class GpuThrottle:
    name = "gpu_throttle"

    def __init__(self) -> None:
        self.throttled = False

    def check(self, rec: dict[str, Any]) -> str | None:
        reasons = sorted(THROTTLING.intersection(rec.get("gpu_throttle_reasons") or ()))
        fired = bool(reasons) and not self.throttled
        self.throttled = bool(reasons)
        if not fired:
            return None
        return (
            f"GPU throttling ({', '.join(reasons)}): SM clock {rec.get('gpu_sm_clock_mhz')} MHz, "
            f"{rec.get('gpu_temp_c')} C, {rec.get('gpu_power_w')} W"
        )


class Alerts:
    """The run's detectors; `check` returns this step's (name, message) pairs and counts them."""

    def __init__(self, detectors: list[Alert]) -> None:
        self.detectors = detectors
        self.counts: dict[str, int] = {d.name: 0 for d in detectors}

    def check(self, rec: dict[str, Any]) -> list[tuple[str, str]]:
        fired = []
        for d in self.detectors:
            msg = d.check(rec)
            if msg is not None:
                self.counts[d.name] += 1
                fired.append((d.name, msg))
        return fired

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# -- the thrashing plan ----


class _NoBytes:
    """A store that allocates nothing: the dry run below moves no data."""

    dev = HostDevice(torch.device("cpu"))  # its events are None: nothing waits

    def alloc(self, tier: Tier, cls: Any, numel: int, dtype: Any = None) -> torch.Tensor:
        return torch.empty(0)

    def free(self, tier: Tier, cls: Any, t: torch.Tensor) -> None:
        pass


class _NoLoad:
    def start(self, dst: torch.Tensor, after: Any) -> None:
        pass

    def finish(self, dst: torch.Tensor) -> None:
        pass


def planned_fetches(cache: StreamCache, plan: list[list[int]]) -> dict[int, int]:
    """Fetches per segment that the stream cache's own policy (eviction by next use, prefetch
    evicting ahead) makes for the access sequence `plan`, as the engine drives it: the
    segments of action k acquired in order, then the prefetch for action k + 1. Running the real
    class keeps the plan and the cache from drifting apart."""
    no_store: Any = _NoBytes()
    dry = StreamCache(no_store, cache.nbytes, cache.capacity_bytes, lambda s: _NoLoad())
    dry.begin(plan)
    for k, segs in enumerate(plan):
        for s in segs:
            dry.acquire(k, s)
        dry.reads_done(k)
        dry.prefetch(k + 1)
    dry.drop_all()
    return dict(dry.fetches)

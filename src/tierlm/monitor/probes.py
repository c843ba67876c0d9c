"""Per-step measurements beyond what the stepper returns, as metrics.jsonl fields.

Each probe adds a fixed set of keys to the step record; `build_probes` picks, at setup, the
implementation that fits this run (tiered runtime or reference, CUDA or CPU, NVML or not), and a
probe with nothing to measure fills its keys with None, so every run's records carry the same
fields. Rates: `<link>_Bps` is the link's throughput while busy (bytes / summed transfer time,
from the ledger); `<link>_bytes_per_s` is the swap rate (bytes moved / step time).
"""

from __future__ import annotations

import resource
import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil
import torch

from tierlm.memory.ledger import Ledger
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.monitor.alerts import planned_fetches
from tierlm.monitor.nvml import GpuSampler

if TYPE_CHECKING:
    from tierlm.runtime.engine import Engine
    from tierlm.runtime.stepper import Stepper

LOSS_WINDOW = 10  # steps in `loss_var`; the loss-spike rule uses the same window

LEDGER_KEYS = [
    *(f"{t}_{k}" for t in Tier for k in ("bytes", "peak_bytes", "step_peak_bytes")),
    *(f"{link}_{k}" for link in Link for k in ("bytes", "Bps")),
]


class Probe(Protocol):
    def fields(self, rec: dict[str, Any]) -> dict[str, Any]: ...


class StepTime:
    """Splits the step: compute (forward, backward and on-device updates, timed by the stepper
    around that work), transfer wait (weights not yet on the device) and update wait (the
    previous step's background optimizer update not yet done). The rest of `step_time_s` is
    neither: loading the batch, copies and disk writes the step does not wait on separately,
    gradient sync, bookkeeping."""

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return {
            "compute_s": rec["compute_s"],
            "transfer_wait_s": rec.get("transfer_wait_s") or 0.0,
            "update_wait_s": rec.get("update_wait_s") or 0.0,
        }


class LossWindow:
    """Variance of the finite losses of the last `window` steps (None below two)."""

    def __init__(self, window: int = LOSS_WINDOW) -> None:
        self.losses: deque[float] = deque(maxlen=window)

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        loss = rec["loss"]
        if isinstance(loss, float) and loss == loss and abs(loss) != float("inf"):
            self.losses.append(loss)
        if len(self.losses) < 2:
            return {"loss_var": None}
        mean = sum(self.losses) / len(self.losses)
        return {"loss_var": sum((x - mean) ** 2 for x in self.losses) / len(self.losses)}


class Moves:
    """Ledger fields (None without a ledger), swap rates per link and PCIe utilisation (bytes
    moved per second of step / the link's peak per direction; None without NVML's link data)."""

    def __init__(self, ledger: Ledger | None, pcie_peak_Bps: float | None) -> None:
        self.ledger = ledger
        self.pcie_peak_Bps = pcie_peak_Bps

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {k: rec.get(k) for k in LEDGER_KEYS}
        for link in Link:
            nbytes = out[f"{link}_bytes"]
            out[f"{link}_bytes_per_s"] = (
                nbytes / rec["step_time_s"] if nbytes is not None else None
            )
        for link in (Link.H2D, Link.D2H):
            rate = out[f"{link}_bytes_per_s"]
            out[f"pcie_{link}_util"] = (
                rate / self.pcie_peak_Bps if rate is not None and self.pcie_peak_Bps else None
            )
        return out


def _peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM): the CPU has no allocator statistics."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class HostMemory:
    """The process's resident set, current and peak (on a CPU-only machine the device tier
    lives there too). The trainer's memory watch may have measured them already."""

    def __init__(self) -> None:
        self.proc = psutil.Process()

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return {
            "rss_bytes": rec.get("rss_bytes") or self.proc.memory_info().rss,
            "rss_peak_bytes": rec.get("rss_peak_bytes") or _peak_rss_bytes(),
        }


class CudaMemory:
    """The caching allocator's allocated bytes (what tensors hold; not nvidia-smi's number),
    current and peak since the run started; the bytes it reserved from the driver (allocated
    plus its cache: their gap is fragmentation) and its retries so far (a failed cudaMalloc
    that freed the cache and tried again: tierlm.memory.cuda_allocator). On CUDA only: a CPU
    run's records have no reserved or retry fields."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        stats = torch.cuda.memory_stats(self.device)
        return {
            "cuda_allocated_bytes": torch.cuda.memory_allocated(self.device),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(self.device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
        }


class NoCuda:
    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return {"cuda_allocated_bytes": None, "cuda_max_allocated_bytes": None}


class StreamFetches:
    """Segments fetched to the device this step against the schedule's plan; over-plan
    segments are listed by name (the thrashing alert reads them)."""

    def __init__(self, engine: Any, micro_batches: int) -> None:
        self.cache = engine.cache
        self.names = [st.seg.name for st in engine.states]
        self.planned = planned_fetches(engine.cache, engine.stream_plan(micro_batches))

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        got = self.cache.fetches  # reset by the cache at the start of every step
        total = sum(got.values())
        over = {
            self.names[s]: [n, self.planned.get(s, 0)]
            for s, n in sorted(got.items())
            if n > self.planned.get(s, 0)
        }
        return {
            "segments_fetched": total,
            "segments_fetched_planned": sum(self.planned.values()),
            "segments_fetched_per_s": total / rec["step_time_s"],
            "segments_over_plan": over,
        }


class NoStream:
    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return dict.fromkeys(
            ("segments_fetched", "segments_fetched_planned", "segments_fetched_per_s",
             "segments_over_plan")
        )


FP8_KEYS = ("fp8_underflow_rate", "fp8_overflow_rate", "fp8_underflow_by_layer")


class Fp8Stats:
    """fp8 under/overflow from a stepper that computes in fp8. Contract: the stepper's
    `fp8_stats()` returns {layer name: (underflow fraction, overflow fraction)} for the values
    cast to fp8 since the previous call; the run-wide rates are the mean over layers."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        per_layer = self.stats()
        if not per_layer:
            return dict.fromkeys(FP8_KEYS)
        n = len(per_layer)
        return {
            "fp8_underflow_rate": sum(u for u, _ in per_layer.values()) / n,
            "fp8_overflow_rate": sum(o for _, o in per_layer.values()) / n,
            "fp8_underflow_by_layer": {k: u for k, (u, _) in per_layer.items()},
        }


class NoFp8:
    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return dict.fromkeys(FP8_KEYS)


class Gpu:
    def __init__(self, sampler: GpuSampler) -> None:
        self.sampler = sampler

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return self.sampler.sample()


class Speculation:
    """What became of the step's speculative disk-tier updates (`Engine.speculation`:
    tierlm.runtime.update.SpeculationCounts). Unlike the other probes' fields, these are absent
    from the records of a run that speculates nothing (`speculates`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def speculates(engine: Any) -> bool:
        return engine is not None and engine.speculating

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return self.engine.speculation.fields()


class SpeculationNotice:
    """The run's log lines about redone speculations, each once: at the first redo (clipping
    was active, so the speculative updates were done twice), and once more than half of the
    first `window` steps that speculated (or of every later count of them) redid them, where
    `--speculative-update off` would do the updates once."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.steps = 0  # steps that speculated
        self.redone_steps = 0
        self.first_said = False
        self.off_said = False

    def check(self, rec: dict[str, Any]) -> str | None:
        if not rec.get("speculated_segments"):
            return None
        self.steps += 1
        redone = rec.get("speculation_redone", 0)
        self.redone_steps += bool(redone)
        if redone and not self.first_said:
            self.first_said = True
            return (f"gradient clipping was active (coefficient below 1), so {redone} of "
                    f"{rec['speculated_segments']} speculative disk-tier updates were redone, "
                    f"moving {rec.get('speculation_redo_disk_bytes', 0) / 2**20:,.1f} MiB more "
                    "on the disk (their reads and writes again)")
        if (not self.off_said and self.steps >= self.window
                and 2 * self.redone_steps > self.steps):
            self.off_said = True
            return (f"speculative updates were redone on {self.redone_steps} of {self.steps} "
                    "steps (clipping binds on most steps), so they cost disk traffic and save "
                    "nothing: pass --speculative-update off")
        return None


def build_probes(stepper: Stepper, device: torch.device, gpu: GpuSampler, micro_batches: int):
    """The probes for this run, in the order their fields are added."""
    engine = stepper.engine  # the tiered runtime: its schedule plans the stream's fetches
    return [
        StepTime(),
        LossWindow(),
        Moves(stepper.ledger, gpu.pcie_peak_Bps),
        HostMemory(),
        CudaMemory(device) if device.type == "cuda" else NoCuda(),
        StreamFetches(engine, micro_batches) if engine is not None else NoStream(),
        Fp8Stats(stepper.fp8_stats) if stepper.fp8_stats is not None else NoFp8(),
        Gpu(gpu),
        *((Speculation(engine),) if Speculation.speculates(engine) else ()),
    ]


PROBE_REQUEST_CAP_BYTES = 32 << 20


def disk_segment_bytes(engine: Engine | None) -> int:
    """The size of the run's disk requests (the largest disk-resident segment's fp32 copy), for
    the probe: capped, since larger requests only run faster, so the probe stays ~a second.
    0 without the tiered runtime (`engine` None): nothing on disk."""
    states = engine.states if engine is not None else []
    sizes = [st.numel * 4 for st in states if st.tier == Tier.DISK]
    return min(max(sizes, default=0), PROBE_REQUEST_CAP_BYTES)


def probe_disk_Bps(
    directory: str | Path, request_bytes: int, requests: int = 4
) -> dict[str, float]:
    """Reference disk-tier throughput in `directory`, measured the way the ledger measures the
    run: `requests` concurrent files of `request_bytes` (an update reads and writes its segment's
    copies together) through a `Store`, rate = bytes / summed request time. Files are written
    once first, as the run's are preallocated, then the timed write and read; best of two."""
    root = Path(tempfile.mkdtemp(prefix=".tierlm-disk-probe-", dir=directory))
    store = Store(torch.device("cpu"), offload_dir=root)
    numel = max(1, request_bytes // 4)
    bufs = [store.alloc(Tier.HOST, TensorClass.STAGING, numel).fill_(1.0) for _ in range(requests)]
    best = {"disk_write": 0.0, "disk_read": 0.0}
    try:
        for f in [store.write_file(f"p{i}", b, TensorClass.GRAD) for i, b in enumerate(bufs)]:
            f.result()
        for _ in range(2):
            store.ledger.reset_step()
            for f in [store.write_file(f"p{i}", b, TensorClass.GRAD) for i, b in enumerate(bufs)]:
                f.result()
            for f in [store.read_file(f"p{i}", b) for i, b in enumerate(bufs)]:
                f.result()
            snap = store.ledger.snapshot()
            for link in best:
                best[link] = max(best[link], snap[f"{link}_Bps"] or 0.0)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return best

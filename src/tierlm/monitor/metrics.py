"""Monitoring: every step's record, enriched by the probes, checked by the alerts, written to
RUN_DIR/metrics.jsonl (and TensorBoard), and shown in the live view.

`build_monitor` resolves at setup what this run can measure (tiered runtime or reference, CUDA,
NVML, a disk tier, TensorBoard); the loop then calls `Monitor.step(rec)` and `Monitor.eval(rec)`
unconditionally. `MetricsLog` appends one JSON object per line and flushes each line, so a crash
loses at most the line being written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from tierlm.config import Config, ConfigError
from tierlm.memory.tiers import Link
from tierlm.monitor.alerts import (
    Alert,
    Alerts,
    DiskSlow,
    DiskWearAlert,
    GpuThrottle,
    LossSpike,
    NonFinite,
    Thrashing,
)
from tierlm.monitor.live import fmt_rate, open_view
from tierlm.monitor.nvml import NoGpu, open_gpu_sampler
from tierlm.monitor.probes import (
    LossWindow,
    Probe,
    Speculation,
    SpeculationNotice,
    build_probes,
    disk_segment_bytes,
    probe_disk_Bps,
)
from tierlm.progress import NO_PROGRESS, Progress
from tierlm.runtime.stepper import Stepper


class MetricsLog:
    def __init__(self, path: Path, *, resume_from_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and path.exists():
            self._truncate_after(resume_from_step)
        elif resume_from_step is None and path.exists():
            path.unlink()
        self._f: TextIO = path.open("a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        """Drop records written after the checkpoint we resume from: that work is redone."""
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if rec.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    return out


def _tb_tag(key: str) -> str:
    """TensorBoard groups scalars by the part before the slash."""
    if key.startswith(("loss", "eval_")):
        group = "loss"
    elif key.startswith("gpu_"):
        group = "gpu"
    elif key.startswith("fp8_"):
        group = "fp8"
    elif key.endswith(("_Bps", "_bytes_per_s", "_util")) or key.startswith(
        ("segments_", *(f"{link}_" for link in Link))
    ):
        group = "moves"
    elif key.endswith("_bytes"):
        group = "memory"
    elif key.endswith("_s"):
        group = "time"
    else:
        group = "train"
    return f"{group}/{key}"


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        self.writer = _summary_writer()(log_dir=str(log_dir))

    def write(self, rec: dict[str, Any]) -> None:
        for key, value in rec.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(_tb_tag(key), value, rec["step"])

    def close(self) -> None:
        self.writer.close()


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "--tensorboard needs the tensorboard package: pip install 'tierlm[tensorboard]' "
            "(or drop --tensorboard; metrics.jsonl has the same numbers)"
        ) from None
    return SummaryWriter


def check_monitor_deps(cfg: Config) -> None:
    """Fail before any work when an optional dependency the config asks for is missing."""
    if cfg.monitor.tensorboard:
        _summary_writer()


class SkippedSteps:
    def __init__(self, stepper: Stepper) -> None:
        self.stepper = stepper

    def fields(self, rec: dict[str, Any]) -> dict[str, Any]:
        return {"skipped_steps": self.stepper.skipped_steps}


class Monitor:
    """What the loop calls: `start` (opens the live view), `step`, `eval`, `log`, `close`."""

    def __init__(
        self,
        metrics: MetricsLog,
        probes: list[Probe],
        alerts: Alerts,
        *,
        sinks: tuple[TensorBoardSink, ...] = (),
        every: int = 10,
        log: Callable[[str], None] = print,
        summaries: list[Callable[[], str | None]] = (),
        phases: Progress = NO_PROGRESS,
        notices: tuple[Alert, ...] = (),  # the alerts' interface, but not counted as alerts
    ) -> None:
        self.summaries = list(summaries)
        self.notices = notices  # log lines a record may call for
        self.phases = phases  # the run's progress: its terminal view draws it while open
        self.metrics = metrics
        self.probes = probes
        self.alerts = alerts
        self.sinks = sinks
        self.every = every
        self._log = log
        self.view: Any = None
        self.last_eval: dict[str, Any] | None = None

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Bring windows, detectors and alert counts up to date with the records of the run we
        resume (metrics.jsonl after truncation), without logging anything again."""
        for rec in records:
            if "eval_loss" in rec:
                self.last_eval = rec
            elif "loss" in rec:
                for p in self.probes:
                    if isinstance(p, LossWindow):
                        p.fields(rec)
                self.alerts.check(rec)

    def start(self, total_steps: int, start_step: int, stream: TextIO | None = None) -> Monitor:
        self.view = open_view(total_steps, start_step, stream=stream, every=self.every,
                              phases=self.phases)
        return self

    def log(self, message: str) -> None:
        if self.view is not None:
            self.view.log(message)
        else:
            self._log(message)

    def step(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Add the probes' fields to `rec`, check alerts, write it and show it."""
        for p in self.probes:
            rec.update(p.fields(rec))
        fired = self.alerts.check(rec)
        rec["alerts"] = [name for name, _ in fired]
        rec["alert_messages"] = [msg for _, msg in fired]
        self.metrics.write(rec)
        for sink in self.sinks:
            sink.write(rec)
        for name, msg in fired:
            self.log(f"step {rec['step']}: alert {name}: {msg}")
        for notice in self.notices:
            line = notice.check(rec)
            if line:
                self.log(f"step {rec['step']}: {line}")
        if self.view is not None:
            self.view.update(rec, self.last_eval, self.alerts.counts)
        return rec

    def eval(self, rec: dict[str, Any]) -> None:
        self.last_eval = rec
        self.metrics.write(rec)
        for sink in self.sinks:
            sink.write(rec)
        self.log(f"step {rec['step']}: held-out loss {rec['eval_loss']:.4f}, "
                 f"perplexity {rec['eval_ppl']:.2f}")
        if self.view is not None:
            self.view.show_eval(rec)

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
            for summary in self.summaries:
                line = summary()
                if line:
                    self._log(line)
        for sink in self.sinks:
            sink.close()
        self.sinks = ()


def build_monitor(
    cfg: Config,
    stepper: Stepper,
    device: torch.device,
    run_dir: Path,
    metrics: MetricsLog,
    *,
    log: Callable[[str], None] = print,
    phases: Progress = NO_PROGRESS,
) -> Monitor:
    gpu = open_gpu_sampler(device)
    probes: list[Probe] = [
        *build_probes(stepper, device, gpu, cfg.train.grad_accum_steps),
        SkippedSteps(stepper),
    ]
    detectors: list[Alert] = [LossSpike(), NonFinite()]
    if stepper.cache is not None:
        detectors.append(Thrashing())
    summaries: list[Callable[[], str | None]] = []  # logged when the run's view closes
    engine = stepper.engine
    request_bytes = disk_segment_bytes(engine)
    if engine is not None and request_bytes:
        ref = probe_disk_Bps(engine.opts.offload_dir, request_bytes)
        log(f"disk probe ({request_bytes / 2**20:.1f} MiB requests): write "
            f"{fmt_rate(ref['disk_write'])}, read {fmt_rate(ref['disk_read'])}; the disk_slow "
            "alert compares the run with these")
        detectors.append(DiskSlow(ref))
        wear = DiskWearAlert(cfg.memory.disk_endurance_tbw)
        detectors.append(wear)
        summaries.append(wear.summary)
    if not isinstance(gpu, NoGpu):
        detectors.append(GpuThrottle())
    sinks = (TensorBoardSink(run_dir / "tensorboard"),) if cfg.monitor.tensorboard else ()
    notices = (SpeculationNotice(),) if Speculation.speculates(engine) else ()
    monitor = Monitor(metrics, probes, Alerts(detectors), sinks=sinks,
                      every=cfg.monitor.log_every, log=log, summaries=summaries,
                      phases=phases, notices=notices)
    if metrics.path.exists():
        monitor.replay(read_metrics(metrics.path))
    return monitor

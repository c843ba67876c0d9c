"""`--monitor.trace_step N`: the trainer's side of the step timeline (tierlm.trace).

Decided at setup: `build_tracer` gives the runtime a `Tracer` (or `NO_TRACER`), and
`build_step_trace` the loop a `StepTrace` (or `NoStepTrace`) that it calls around every step.
Before step N the tracer is armed; after it, the runtime is synchronised (the step's own
optimizer updates run in the background, behind the next step's forward: waiting for them here
costs step N+1 that overlap), the events are collected, and RUN_DIR/trace.json is written with
the planner's predicted timeline of the same step beside them and, as metadata, the step's
measured times and the placement (segment x tier, bytes per class).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierlm.config import Config
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.plan.result import Plan
from tierlm.runtime.stepper import Stepper
from tierlm.trace import NO_TRACER, NoTracer, TraceEvent, Tracer, chrome_trace

TRACE_FILE = "trace.json"
TIME_KEYS = ("step_time_s", "compute_s", "transfer_wait_s", "update_wait_s", "sweep_s")


def build_tracer(cfg: Config, device: torch.device, is_main: bool) -> Tracer | NoTracer:
    return Tracer(device) if cfg.monitor.trace_step and is_main else NO_TRACER


class NoStepTrace:
    def before(self, step: int) -> None:
        return None

    def after(self, rec: dict[str, Any]) -> None:
        return None


class StepTrace:
    def __init__(self, step: int, tracer: Tracer, engine: Any, run_dir: Path,
                 predict: Callable[[], list[TraceEvent]], plan: Plan | None,
                 log: Callable[[str], None]) -> None:
        self.step, self.tracer, self.engine, self.run_dir = step, tracer, engine, run_dir
        self.predict, self.plan, self.log = predict, plan, log

    def before(self, step: int) -> None:
        """Called with the number the next step will have."""
        if step == self.step:
            self.tracer.arm()
            self.before_s = time.perf_counter()  # the trainer's step starts now

    def after(self, rec: dict[str, Any]) -> None:
        """Called with the step's record, once the monitor has added its fields."""
        if rec["step"] != self.step:
            return
        end_s = time.perf_counter()
        self.engine.synchronize()  # the step's own updates, still running in the background
        # the waits `synchronize` itself records are the trace's, not the step's
        events = [e for e in self.tracer.disarm() if e.lane != "wait" or e.start_s < end_s]
        origin_s = self.tracer.origin_s
        dev = self.engine.dev
        if dev.kind == "sim":  # --device sim:PROFILE: the step in the simulated GPU's time
            origin_s = dev.step_window_s[0]
            events = [TraceEvent(op.lane, op.name, op.cat, op.start_s, op.end_s, dict(op.args))
                      for op in dev.step_ops]
            events.append(TraceEvent("step", "step", "step", *dev.step_window_s))
        else:
            # the trainer's part of the step before the runtime's (drawing the micro-batches)
            # is compute in `compute_s` too
            begin = min((e.start_s for e in events if e.lane == "step"), default=end_s)
            events.insert(0, TraceEvent("step", "draw batches", "step", self.before_s, begin))
        trace = chrome_trace(
            events, origin_s, self.predict(),
            step=self.step,
            measured_s={k: rec[k] for k in TIME_KEYS if rec.get(k) is not None},
            predicted_times_s=self.plan.times_s if self.plan is not None else None,
            placement=placement_map(self.engine),
            lanes_note=(
                "compute: the step's actions, its begin and finish and the trainer's drawing "
                "of the batches: the step less its waits for weights and updates (compute_s), "
                "host clock; wait: those waits; H2D/D2H: store copies (CUDA events "
                "on a GPU); disk read/write: one event per request, from its first chunk "
                "starting to its last finishing; cpu update: the optimizer math per segment. "
                "A lane with events in flight together is split into rows ('disk read 2')."
            ),
        )
        path = self.run_dir / TRACE_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(trace), encoding="utf-8")
        os.replace(tmp, path)
        self.log(f"step {self.step}: timeline of {len(events)} events in {path} (open it in "
                 "ui.perfetto.dev, or run tierlm report)")


def build_step_trace(cfg: Config, tracer: Tracer | NoTracer, stepper: Stepper,
                     plan: Plan | None, predict: Callable[[], list[TraceEvent]], run_dir: Path,
                     log: Callable[[str], None]) -> StepTrace | NoStepTrace:
    """`predict`: the planner's timeline of the traced step (the trainer builds it from the
    run's config, which monitor/ does not read), called once, after the step."""
    if not isinstance(tracer, Tracer):
        return NoStepTrace()
    if stepper.engine is None:  # config validation allows tracing only the tiered runtime
        raise ValueError("--monitor.trace_step: this run's stepper is not the tiered runtime")
    return StepTrace(cfg.monitor.trace_step, tracer, stepper.engine, run_dir, predict, plan, log)


def placement_map(engine: Any) -> list[dict[str, Any]]:
    """Per segment: where its state lives and the bytes it holds per tier and tensor class
    (streamed compute weights visit the device only while their action runs: not counted)."""
    out = []
    for st in engine.states:
        n, tier = st.numel, st.placement.state_tier
        held: dict[str, dict[str, int]] = {}

        def add(t: Tier, cls: TensorClass, nbytes: int, held=held) -> None:
            by_class = held.setdefault(str(t), {})
            by_class[str(cls)] = by_class.get(str(cls), 0) + nbytes

        # a frozen base held in its own copy (NF4, or bf16 under --precision bf16) alone
        nf4 = st.frozen and st.compute_format is not None
        if not nf4:
            add(tier, TensorClass.MASTER, 4 * n)
        if not st.frozen:  # a LoRA run's base is its master alone
            add(tier, TensorClass.OPTIM, 8 * n)
            add(tier, TensorClass.GRAD, 4 * n)
        trained = engine.trained[st.index]
        if trained is not None and trained is not st:  # its adapters, on the device
            for cls, per in ((TensorClass.MASTER, 4), (TensorClass.OPTIM, 8),
                             (TensorClass.GRAD, 4)):
                add(Tier.DEVICE, cls, per * trained.numel)
        # the device copy of a resident segment (an NF4 base's device tier: its only copy)
        if st.placement.resident and tier != Tier.DEVICE or nf4 and tier == Tier.DEVICE:
            add(Tier.DEVICE, TensorClass.COMPUTE, st.device_nbytes())
        if st.wire is not None:
            add(Tier.HOST, TensorClass.COMPUTE, st.wire.numel() * st.wire.element_size())
        elif st.compute_format is not None and tier == Tier.DISK:  # its compute file
            add(Tier.DISK, TensorClass.COMPUTE, st.compute_format.nbytes)
        out.append({"segment": st.seg.name, "numel": n, "resident": st.placement.resident,
                    "state_tier": str(tier), "bytes": held})
    return out

"""Monitoring: what a run records about itself, how it shows it, and the report made from it.

Two layers live here. `trace.py` (the step timeline recorder) and `progress.py` (phase progress)
import nothing of tierlm: the runtime, the memory tiers and the model loader call into them.
The rest sits above the runtime and below train/ (it never imports tierlm.train):

- metrics.py: each step's record, MetricsLog (metrics.jsonl), TensorBoard, `build_monitor`
- probes.py: what a step measures (times, moves, RSS, CUDA memory, stream fetches, fp8, GPU)
- alerts.py: the alerts checked on every record (loss spike, non-finite, thrashing, slow disk,
  disk wear, GPU throttling)
- live.py: the live terminal view; nvml.py: the GPU sampler (NVML)
- step_trace.py: `--monitor.trace_step`, the trainer's side of trace.json
- report.py, plots.py, trace_plots.py: `tierlm report` and its figures
"""

from tierlm.monitor.trace import NO_TRACER, NoTracer, TraceEvent, Tracer

__all__ = ["NO_TRACER", "NoTracer", "TraceEvent", "Tracer"]

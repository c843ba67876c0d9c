"""Monitoring: what a run records about itself, how it shows it, and the report made from it.

It sits above plan/ (the step trace draws the plan's predicted timeline) and below train/ (it
never imports tierlm.train). The step timeline recorder and phase progress, which every layer
calls, are the leaves tierlm/trace.py and tierlm/progress.py, below every package.

- metrics.py: each step's record, MetricsLog (metrics.jsonl), TensorBoard, `build_monitor`
- probes.py: what a step measures (times, moves, RSS, CUDA memory, stream fetches, fp8, GPU)
- alerts.py: the alerts checked on every record (loss spike, non-finite, thrashing, slow disk,
  disk wear, GPU throttling)
- live.py: the live terminal view; nvml.py: the GPU sampler (NVML)
- step_trace.py: `--monitor.trace_step`, the trainer's side of trace.json
- report.py, plots.py, trace_plots.py: `tierlm report` and its figures
"""

"""The planner: every choice and every prediction, above runtime/ and distributed/.

A pure function from (model shapes, hardware profile, training shape) to a plan: which segments
keep their compute weights and state on the device, where every other segment's state lives, the
recompute and micro-batch order, with the peak bytes per tier and the step time it predicts.

- search: the search over placements (`plan`), and what would fit when nothing does (advice)
- evaluate: one candidate's bytes (the byte replay, tierlm.runtime.byte_replay) and times
- timing: the time model per lane; replay: the simulated step on a TimingDevice
- result: `Plan`, the usable budgets, the problems; describe: the plan in words and flags
- timeline: the predicted step as trace events; probe: the hardware probe's measurements

The model and step shapes (`ModelShape`, `TrainShape`) and the byte replay live in runtime/,
beside the walk they replay.
"""

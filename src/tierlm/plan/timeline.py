"""The planner's step as a timeline: the replay's operations, drawn as trace events.

The plan's prediction is the replay of the engine's operations on a timing device
(tierlm.plan.replay.simulate_step, run for a plan by `evaluate.replay_plan`): its steady-state
step (the second of two; the first fills the stream cache and runs the update the second waits
for). This lays that step's operations out as the trace's predicted lanes (tierlm.trace), so the
trace a user opens shows the step the plan printed, and the lanes a `--device sim:PROFILE` run
draws for its measured step (the same simulator, the same names):

- each operation as the simulator booked it: its lane (`compute`, `H2D`, `D2H`, `disk` (reads
  and writes share the drive), `cpu` (gradient adds on the training thread), `cpu landing`,
  `cpu update`, with a memory node `net send`, `net recv` and `node cpu`; `wait`: the compute
  stream idle until a copy lands; `<thread> wait`: a host thread blocked), its name, start and
  end in seconds from the step's start, and its arguments (bytes, FLOPs);
- the `step` lane's one event from 0 to the simulated step (`times_s["simulated_step"]`: from
  this step's start to the next one's, on the training thread's clock).

The step's own optimizer updates run on the update worker behind the next step's forward, so
their operations may end after the step's event does; the previous step's updates, which this
step's forward waits for, are the previous step's operations and are not drawn.

The step event's arguments hold the plan's own step (`plan_step_s`, what the run printed): the
same, but where the plan's step is the closed-form estimate: one the simulator does not price
in full (`evaluate.simulation_gap`, named in `not_simulated`).
"""

from __future__ import annotations

from tierlm.memory.hardware import HardwareProfile
from tierlm.plan.evaluate import replay_plan, simulation_gap
from tierlm.plan.result import Plan
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.trace import TraceEvent


def predicted_timeline(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, plan: Plan
) -> list[TraceEvent]:
    """The replay's events for the steady-state step of `plan` (seconds from its start)."""
    timing = replay_plan(shape, train, hw, plan)
    t0 = timing.start_s
    events = [TraceEvent(op.lane, op.name, op.cat, op.start_s - t0, op.end_s - t0,
                         dict(op.args)) for op in timing.ops]
    args: dict[str, object] = {"compute_s": timing.compute_s,
                               "transfer_wait_s": timing.transfer_wait_s,
                               "plan_step_s": plan.step_s}
    gap = simulation_gap(shape, train, hw)
    if gap is not None:
        args["not_simulated"] = gap
    events.append(TraceEvent("step", "step", "step", 0.0, timing.step_s, args))
    return events

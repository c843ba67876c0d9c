"""The planner's step as a timeline: its time model laid out action by action.

The planner predicts per-link totals (`_times`); a trace needs a start and an end per event.
This replays the same step (`_simulate`, the runtime's own schedule and stream cache over byte
counts) with a ledger that logs every move and the action it belongs to, then lays the actions
out with the planner's rates and its overlap assumption:

- compute: the planner's compute time, shared between actions in proportion to their FLOPs
  (forward 2, backward 4 per parameter and token, recomputed blocks +2, attention scores as in
  `_times`; the embedding lookup counts no FLOPs, so its actions take no time);
- transfers: each move's bytes at the profile's link rate (copies at `COPY_EFFICIENCY`), one at a
  time per link. An action's inbound moves (weight loads: disk read, then H2D) come before its
  compute; its outbound moves (gradient D2H, then the disk read/write of the gradient file)
  after it. The loads the replay prefetches for the next action count as that action's inbound;
- overlap: on a GPU profile, as the planner's `max(compute, h2d, d2h, disk)`: an action's
  inbound may start once the previous action's compute has started, and outbound moves run
  behind the next actions' compute. On a CPU profile nothing overlaps (copies and compute share
  the cores; the planner sums them);
- the update: `_times`' own model of it (`planner.update_spans`, the spans of
  `_update_chain`), from the end of the drawn sweep (later by what the read-ahead has not read
  by then): one worker, segment by segment in forward order: for disk state its reads (master,
  gradient, slots, less what is on the host or read ahead), the CPU update, then the writes the
  next forward waits for. With a deferred write-back (`Plan.writeback`) those are the compute
  copy (or the fp32 master where none), and the rest (master and slots, or the slots: see
  `planner.writeback_bytes`) goes to the drive after the segment's update, as one `write-back`
  event on the disk write lane, one segment after another (first in, first out; an update
  waiting while `WriteBack.segments` are pending); the model lets the update's own requests
  share the drive with them, so those may overlap there (drawn as a second row). With the
  write-back inside (`writeback=None`) the update writes its whole state itself. Device-tier
  updates are not modelled (the planner counts them in neither compute nor update time);
- the step: in the runtime the update runs behind the next step's forward, which waits for
  each segment's update; the `step` lane's event ends where `_times`' step does: the drawn
  sweep plus that wait (`update_stall`), or the drive's total for the step where longer.

Moves the replay makes before the first action (resident segments refreshed after the previous
update) are drawn as the first action's inbound; the runtime makes them at each segment's first
use. The result is a model: read the gap to the measured lanes as where the plan's assumptions
fail (waits that were meant to overlap, a link slower than its profile).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.ledger import Ledger
from tierlm.memory.tiers import Link
from tierlm.plan.result import Plan
from tierlm.plan.timing import COPY_EFFICIENCY, update_spans
from tierlm.runtime.byte_replay import _simulate
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.trace import TraceEvent

LANE = {Link.H2D: "H2D", Link.D2H: "D2H", Link.DISK_READ: "disk read",
        Link.DISK_WRITE: "disk write"}


class _MoveLog(Ledger):
    """A ledger that also lists every move with the replay's position when it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.at: tuple[int, str] = (-1, "run")
        self.moves: list[tuple[int, str, Link, int]] = []

    def record_move(self, link: Link, nbytes: int, seconds: float = 0.0) -> None:
        super().record_move(link, nbytes, seconds)
        self.moves.append((*self.at, link, nbytes))


def _action_flops(shape: ModelShape, train: TrainShape, plan: Plan, a: Any) -> float:
    """FLOPs of one action, by the planner's count (`_times`)."""
    tokens = train.batch_size * train.seq_len * len(a.mbs)
    last = len(shape.numels) - 1
    if a.seg == 0:
        return 0.0  # the embedding lookup
    if a.kind == "head":
        return 6.0 * (shape.numels[last] + shape.tied_numel) * tokens
    n = shape.numels[a.seg]
    attn = 2.0 * train.seq_len * shape.hidden_size * tokens  # per block, forward
    if a.kind == "fwd":
        return 2.0 * n * tokens + attn
    p = plan.placements[a.seg]
    recompute = 0.0 if p.resident and plan.keep_resident_activations else 2.0 * n * tokens
    return 4.0 * n * tokens + recompute + 2.0 * attn


def predicted_timeline(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, plan: Plan
) -> list[TraceEvent]:
    """The planner's predicted events for one step of `plan` (times in seconds from 0)."""
    log = _MoveLog()
    actions: list[Any] = []

    def at(k: int, phase: str, a: Any) -> None:
        log.at = (k, phase)
        if phase == "run":
            actions.append(a)

    _simulate(shape, train, plan.placements, plan.order, plan.keep_resident_activations,
              plan.boundary_on_host, ledger=log, on_action=at, readahead=plan.readahead)
    rate = {Link.H2D: hw.h2d_Bps * COPY_EFFICIENCY, Link.D2H: hw.d2h_Bps * COPY_EFFICIENCY,
            Link.DISK_READ: hw.disk_read_Bps, Link.DISK_WRITE: hw.disk_write_Bps}
    n = len(actions)
    inbound: list[list[tuple[Link, int]]] = [[] for _ in range(n)]
    outbound: list[list[tuple[Link, int]]] = [[] for _ in range(n)]
    for k, phase, link, nbytes in log.moves:
        if k >= n or link not in rate:
            continue  # the update is laid out below from the placements
        if k < 0:
            inbound[0].append((link, nbytes))
        elif phase == "prefetch":
            inbound[min(k + 1, n - 1)].append((link, nbytes))
        elif outbound[k] or link == Link.D2H:  # landing starts with the gradient's D2H
            outbound[k].append((link, nbytes))
        else:
            inbound[k].append((link, nbytes))
    flops = [_action_flops(shape, train, plan, a) for a in actions]
    total = sum(flops) or 1.0
    compute_s = plan.times_s["compute"]
    serial = hw.device_is_cpu

    events: list[TraceEvent] = []
    free: dict[str, float] = defaultdict(float)  # lane -> when it is next free
    everything = 0.0  # with nothing overlapping (CPU profile): when anything is next free

    def put(lane: str, name: str, cat: str, earliest: float, dur: float, **args: Any) -> float:
        nonlocal everything
        start = max(earliest, free[lane], everything if serial else 0.0)
        end = start + dur
        free[lane] = end
        if serial:
            everything = end
        events.append(TraceEvent(lane, name, cat, start, end, args))
        return end

    prev_compute_start = 0.0
    sweep_end = 0.0
    for k, a in enumerate(actions):
        label = a.label(shape.names)
        t = prev_compute_start
        for link, nbytes in inbound[k]:
            t = put(LANE[link], f"{link} for {label}", "transfer", t, nbytes / rate[link],
                    bytes=nbytes)
        start = max(t, free["compute"], everything if serial else 0.0)
        t = put("compute", label, "action", start, compute_s * flops[k] / total, k=k)
        prev_compute_start = start
        for link, nbytes in outbound[k]:
            t = put(LANE[link], f"{link} for {label}", "transfer", t, nbytes / rate[link],
                    bytes=nbytes)
        sweep_end = max(sweep_end, t)
    # the update, as `_times` models it (`_update_chain`): it runs after the sweep, behind
    # the next step's forward, which the step ends with once that forward has waited `stall`
    spans, stall = update_spans(shape, train, hw, plan)
    for u in spans:
        name, tier = shape.names[u.seg], plan.placements[u.seg].state_tier
        t = sweep_end + u.start_s
        if plan.placements[u.seg].remote:  # the gradient up, the node's update, the copy back
            net = hw.memory_node.net_Bps if hw.memory_node else 0.0
            for lane, what, cat, dur in (("net send", f"grad {name}", "network", u.read_s),
                                         ("node cpu", f"update {name}", "node", u.cpu_s),
                                         ("net recv", f"copy {name}", "network", u.write_s)):
                args = {"bytes": round(dur * net)} if cat == "network" else {}
                events.append(TraceEvent(lane, what, cat, t, t + dur, args))
                t += dur
            continue
        if u.read_s:
            events.append(TraceEvent("disk read", f"state {name}", "disk", t, t + u.read_s,
                                     {"bytes": round(u.read_s * hw.disk_read_Bps)}))
        t += u.read_s
        events.append(TraceEvent("cpu update", f"update {name}", "update", t, t + u.cpu_s,
                                 {"tier": str(tier)}))
        t += u.cpu_s
        if u.write_s:
            events.append(TraceEvent("disk write", f"state {name}", "disk", t, t + u.write_s,
                                     {"bytes": round(u.write_s * hw.disk_write_Bps)}))
        if u.writeback_s:
            end = sweep_end + u.writeback_end_s
            events.append(TraceEvent("disk write", f"write-back {name}", "disk",
                                     end - u.writeback_s, end,
                                     {"bytes": round(u.writeback_s * hw.disk_write_Bps)}))
    # one drive serves the sweep and the update, write-back included
    step_s = max(sweep_end + stall, plan.times_s["disk"])
    events.append(TraceEvent("step", "step", "step", 0.0, step_s,
                             {"sweep_s": sweep_end, "update_stall_s": step_s - sweep_end}))
    return events

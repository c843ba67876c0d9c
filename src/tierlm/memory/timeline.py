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
- the update: after the sweep, one worker, segment by segment in forward order: for disk state,
  read master, gradient and the optimizer's slots (AdamW: 16 B/param), update on the CPU
  (`cpu_adam_params_per_s`), write master and slots back (AdamW: 12 B/param). In the runtime
  it overlaps the next step's forward, which this one-step view does not draw. Device-tier
  updates are not modelled (the planner counts them in neither compute nor update time).

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
from tierlm.memory.planner import COPY_EFFICIENCY, ModelShape, Plan, TrainShape, _simulate
from tierlm.memory.tiers import Link, Tier
from tierlm.monitor.trace import TraceEvent

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
    t = sweep_end
    for s, (name, numel, p) in enumerate(zip(shape.names, shape.numels, plan.placements,
                                             strict=True)):
        if p.state_tier == Tier.DEVICE:
            continue
        read, written = shape.update_disk_bytes(s, None, host_grad=p.host_grad,
                                                read_ahead=s in plan.readahead_segments)
        if p.state_tier == Tier.DISK and read:  # else: read ahead, or nothing to read
            t = put("disk read", f"state {name}", "disk", t, read / hw.disk_read_Bps,
                    bytes=read)
        t = put("cpu update", f"update {name}", "update", t, numel / hw.cpu_adam_params_per_s,
                tier=str(p.state_tier))
        if p.state_tier == Tier.DISK:
            t = put("disk write", f"state {name}", "disk", t, written / hw.disk_write_Bps,
                    bytes=written)
    return events

"""The planner's search: a pure function from (model shapes, hardware profile, training shape) to
a plan. Under the device/host/disk budgets less a safety margin it chooses which segments keep
their compute weights (and whole state) on the device, where every other segment's state lives
(host RAM, spilling the last blocks to disk first), whether streamed segments keep their forward
graph (or, where the simulated step gains, hold their saved tensors in host RAM:
tierlm.plan.offload), the micro-batch order and the disk read-ahead/write-back, and ranks the
variants that fit by their simulated step."""

from __future__ import annotations

import functools
from collections.abc import Callable

from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    SegmentPlacement,
    keeps_graph,
)
from tierlm.memory.tiers import Tier
from tierlm.plan.advice import _what_would_fit
from tierlm.plan.evaluate import (
    NODE_STAGING_BYTES,
    _evaluate,
    _replay,
    adopt_simulated,
    parked_bytes,
    simulated_times,
    simulation_gap,
    with_speculation,
)
from tierlm.plan.offload import offload_streamed
from tierlm.plan.result import Plan, usable_budgets
from tierlm.runtime.byte_replay import activation_workspace_bytes
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.schedule import landing_ring_numel, step_schedule, transient_grad
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.runtime.state import load_bytes
from tierlm.runtime.writeback import WriteBack


def _priority(names: list[str]) -> list[int]:
    """Segments in the order they deserve the device: embed and head (costliest reload per
    use), then blocks from the last one back (their backward comes first)."""
    return sorted(range(len(names)), key=lambda i: (names[i] not in ("embed", "head"), -i))


def plan(
    shape: ModelShape,
    train: TrainShape,
    hw: HardwareProfile,
    *,
    device_budget: int | None = None,
    host_budget: int | None = None,
    orders: tuple[str, ...] = ("microbatch-outer", "layer-outer"),
    park_boundaries: bool = True,
    advise: bool = True,
    speculative: bool | None = None,
) -> Plan:
    """The fastest predicted plan that fits; if none fits, the closest one with `fits=False`
    and `problems` saying what would make it fit (`advise`: each budget named there is the
    least at which this search finds a plan, checked at the value printed; off, the problems
    alone, for callers that only tabulate whether a plan fits). `speculative`
    (--speculative-update): speculative disk-tier updates on a plan with disk-tier state
    where its disk budget holds their spare files and its simulated step is faster (None), on
    every such plan (True), or never (False)."""
    # the advice searches again under other budgets: the replays (which do not depend on the
    # budgets) are shared, per step shape
    replays: dict[int, tuple[TrainShape, dict]] = {}

    def search(step: TrainShape, profile: HardwareProfile, device: int | None,
               host: int | None, simulate: bool = False) -> Plan:
        cache = replays.setdefault(id(step), (step, {}))[1]
        return _search(shape, step, profile, device, host, orders=orders,
                       park_boundaries=park_boundaries, replays=cache, simulate=simulate,
                       speculative=speculative)

    p = search(train, hw, device_budget, host_budget, simulate=True)
    if not p.fits and advise:
        p.problems = p.problems + _what_would_fit(search, shape, train, hw, p, device_budget,
                                                  host_budget)
    if "simulated_step" not in p.times_s:
        p.times_s.update(simulated_times(shape, train, hw, p))
    p = _speculation(shape, train, hw, p, speculative)
    if simulation_gap(shape, train, hw) is None:
        adopt_simulated(p, train)
    return p


def _search(shape: ModelShape, train: TrainShape, hw: HardwareProfile,
            device_budget: int | None, host_budget: int | None, *, orders: tuple[str, ...],
            park_boundaries: bool, replays: dict | None = None, simulate: bool = False,
            speculative: bool | None = None) -> Plan:
    """`plan`'s search: the fastest plan that fits, else the one that overshoots least.
    `replays`: `_fill_host`'s cache, shared by searches of one step shape. Each variant (order,
    activations, boundary tier) grows its placement by the formula (`_times`: thousands of
    candidates); `simulate`: the variants that fit are then ranked by their simulated step
    (the replay of the engine's operations, `simulated_times`: one per variant, 0.2-2 s each
    at 7B), so the plan chosen is the one the simulated GPU runs fastest, each with
    speculative disk-tier updates where `speculative` lets them gain (`_speculation`). Off
    for the advice's searches, which only ask whether a plan fits."""
    replays = {} if replays is None else replays
    budgets = usable_budgets(hw, device_budget=device_budget, host_budget=host_budget)
    best: Plan | None = None
    fallback: Plan | None = None
    fitting: list[Plan] = []
    # kept graphs pin their boundary inputs on the device: parking them on the host goes with
    # recomputing every segment
    # (park_boundaries False: the run's activation policy keeps graphs somewhere)
    variants = [(order, keep, host) for order in (orders if train.micro_batches > 1 else orders[:1])
                for keep, host in ((True, False), (False, False), (False, True))
                if park_boundaries or not host]
    # with a memory node, each variant is also grown without it: over a slow link the node's
    # updates can take longer than the disk's, and a plan with a node is never slower than
    # the same hardware without it
    fills = [budgets] if "remote" not in budgets else [budgets, {**budgets, "remote": 0}]
    variants = [(order, keep, host, fill) for order, keep, host in variants for fill in fills]
    for order, keep, host, fill in variants:
        candidate = _grow_variant(shape, train, hw, order, keep, host, fill, replays)
        if simulate:  # the blocks still recomputing: offloaded where the simulated step gains
            candidate = offload_streamed(shape, train, hw, candidate, fill)
        candidate.budgets = budgets  # (the node's unused: its memory is still there)
        if candidate.fits:
            fitting.append(candidate)
        if candidate.fits and (best is None or candidate.step_s < best.step_s):
            best = candidate
        if fallback is None or _overshoot(candidate) < _overshoot(fallback):
            fallback = candidate
    if best is not None and simulate and len(fitting) > 1:
        for candidate in fitting:
            if "simulated_step" not in candidate.times_s:  # (offload_streamed simulated some)
                candidate.times_s.update(simulated_times(shape, train, hw, candidate))
        fitting = [_speculation(shape, train, hw, c, speculative) for c in fitting]
        # ties (equal simulated steps) go to the formula's order
        return min(fitting, key=lambda c: (c.times_s["simulated_step"], c.step_s))
    if best is not None:
        return best
    assert fallback is not None
    return fallback


def _grow_variant(shape: ModelShape, train: TrainShape, hw: HardwareProfile, order: str,
                  keep: bool, host: bool, budgets: dict[str, int], replays: dict) -> Plan:
    """One variant of `_search` (order, activations, boundary tier) grown under `budgets`."""
    n = len(shape.names)
    # the write-back inside the update: _disk_options tries deferring it
    start = _fill_host(shape, train, hw, [SegmentPlacement(False, Tier.HOST)] * n,
                       order, keep, host, budgets, replays=replays)
    grow = functools.partial(_grow, shape, train, hw, order=order, keep=keep, host=host,
                             budgets=budgets, replays=replays)
    candidate = grow(start, _priority(shape.names))
    if not candidate.fits:  # the largest state first: most RAM freed per segment moved
        by_size = grow(start, sorted(range(n), key=lambda i: -shape.state_bytes(i)))
        if by_size.fits or _overshoot(by_size) < _overshoot(candidate):
            candidate = by_size
    candidate = _disk_options(shape, train, hw, candidate, budgets, replays)
    return _keep_streamed(shape, train, hw, candidate, budgets)


def _speculation(shape: ModelShape, train: TrainShape, hw: HardwareProfile, p: Plan,
                 speculative: bool | None) -> Plan:
    """`p` (simulated) with speculative disk-tier updates where it has disk-tier state that
    trains and `speculative` is True, or is None and with them it still fits and its simulated
    step is shorter; else `p`. The step of the variant not taken stays in `times_s`
    (`simulated_step_speculative`, `simulated_step_plain`) for the plan's description."""
    tried = "simulated_step_speculative" in p.times_s or "simulated_step_plain" in p.times_s
    # (one process only: the engine's speculation reads a gradient before a sync across
    # ranks has averaged it)
    if speculative is False or p.speculative or tried or shape.frozen or train.nproc > 1 or \
            not any(pl.state_tier == Tier.DISK for pl in p.placements):
        return p
    q = with_speculation(shape, train, hw, p)
    if not q.fits and speculative is None and q.host_peak_bytes > p.budgets["host"]:
        # the speculations' staging does not fit beside this placement's host state: the same
        # device choice with that much host RAM kept free (more state on disk)
        spilled = _fill_host(shape, train, hw, p.placements, p.order,
                             p.keep_resident_activations, p.boundary_on_host, p.budgets,
                             reserve=q.host_peak_bytes - p.host_peak_bytes,
                             host_grads=any(pl.host_grad for pl in p.placements),
                             readahead=p.readahead, writeback=p.writeback)
        if spilled.fits:
            spilled.times_s.update(simulated_times(shape, train, hw, spilled))
            q = with_speculation(shape, train, hw, spilled)
    take = speculative or (q.fits and q.times_s["simulated_step"] < p.times_s["simulated_step"])
    if take:
        q.times_s["simulated_step_plain"] = p.times_s["simulated_step"]
        return q
    p.times_s["simulated_step_speculative"] = q.times_s["simulated_step"]
    return p


def _keep_streamed(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
                   budgets: dict[str, int]) -> Plan:
    """Streamed blocks keep their graph too, last first (their backward comes first, so their
    saved tensors are held the shortest), while the device budget left by the candidate holds
    their saved tensors: no recompute for them, and nothing else changes (a kept graph holds
    positions in its weights, not the weights: tierlm.activations.policies). The same rule
    `--grad-checkpointing none` applies on its own (tierlm.activations.spec.keep_streamed), by
    the planner's byte model. Not for candidates that recompute every segment or park boundary
    inputs on the host (a kept graph pins its input on the device), nor for a LoRA base (the
    engine recomputes its streamed segments: tierlm.runtime.plan)."""
    if (not candidate.fits or candidate.keep_resident_activations is False
            or candidate.boundary_on_host or shape.frozen):
        return candidate
    keep = keeps_graph(candidate.placements, candidate.keep_resident_activations)
    last = len(keep) - 1
    other = candidate.workspace_bytes - activation_workspace_bytes(shape, train, keep[:last],
                                                                   candidate.order)
    kept = keep
    for s in reversed(range(last)):  # embed too: it saves only its token ids
        if kept[s]:
            continue
        trial = kept[:s] + [True] + kept[s + 1:]
        need = candidate.device_peak_bytes + other + activation_workspace_bytes(
            shape, train, trial[:last], candidate.order)
        if need <= budgets["device"]:
            kept = trial
    if kept == keep:
        return candidate
    p = _evaluate(shape, train, hw, candidate.placements, candidate.order, tuple(kept), budgets,
                  candidate.boundary_on_host, readahead=candidate.readahead,
                  writeback=candidate.writeback)
    return p if p.fits and p.step_s <= candidate.step_s else candidate


def _grow(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
          priority: list[int], *, order: str, keep: bool, host: bool,
          budgets: dict[str, int], replays: dict) -> Plan:
    """Grow the candidate's device share one segment at a time, in `priority` order (first
    resident weights, then state on the device), the rest of the state filled into RAM and
    disk by `_fill_host`: while the plan does not fit, wherever that brings it closer without
    pushing the device further over its budget (state on the device frees host RAM and disk;
    a device already short cannot pay for that); then while it fits and is not slower."""
    for upgrade in ("resident", "state"):
        for i in priority:
            trial = list(candidate.placements)
            cur = trial[i]
            if upgrade == "resident" and not cur.resident:
                trial[i] = SegmentPlacement(True, cur.state_tier)
            elif upgrade == "state" and cur.state_tier != Tier.DEVICE and (
                    cur.resident or not candidate.fits):  # (streamed ones: to fit at all)
                trial[i] = SegmentPlacement(True, Tier.DEVICE)
            else:
                continue
            p = _fill_host(shape, train, hw, trial, order, keep, host, budgets, replays=replays)
            if p.fits:
                if not candidate.fits or p.step_s <= candidate.step_s * 1.0001:
                    candidate = p
            elif not candidate.fits and _overshoot(p) < _overshoot(candidate) and (
                    _device_over(p) <= _device_over(candidate)):
                candidate = p
    return candidate


READAHEAD_EXTRA_SHARES = (0.0, 0.125, 0.25, 0.5, 1.0)


# write-backs pending at most (None: every disk-tier segment's) the planner tries
WRITEBACK_SEGMENTS: tuple[int | None, ...] = (1, 4, None)


def _disk_options(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
                  budgets: dict[str, int], replays: dict | None = None) -> Plan:
    """The candidate with the three disk-tier options tried on its device choices: disk-tier
    gradients held in host RAM (fewer segments' state fits there); the update's read-ahead
    during the backward with a host budget of a share of the disk-tier update state beyond
    what the backward frees; and the write-back deferred behind the step, up to some
    segments' master and slots pending in host staging (the read-ahead's share and the
    write-back's segments are reserved, so fewer segments' state fits on the host). The
    fastest that fits, or the candidate."""
    if shape.frozen or not any(p.state_tier == Tier.DISK for p in candidate.placements):
        return candidate
    order, keep, host = (candidate.order, candidate.keep_resident_activations,
                         candidate.boundary_on_host)
    largest = max(shape.update_state_bytes(s) for s in range(len(shape.numels)))
    # the sweep does not depend on the write-back: replayed once
    replays = {} if replays is None else replays
    best = candidate
    for host_grads in (False, True):
        base = _fill_host(shape, train, hw, candidate.placements, order, keep, host, budgets,
                          host_grads=host_grads, replays=replays)
        disk_state = sum(shape.update_state_bytes(s) for s, p in enumerate(base.placements)
                         if p.state_tier == Tier.DISK)
        n_disk = sum(p.state_tier == Tier.DISK for p in base.placements)
        limits = sorted({n_disk if n is None else min(n, n_disk) for n in WRITEBACK_SEGMENTS})
        for share in (None, *READAHEAD_EXTRA_SHARES):
            extra = 0 if share is None else int(share * disk_state)
            ra = None if share is None else ReadAhead(extra_bytes=extra)
            for segments in (None, *limits):
                wb = None if segments is None else WriteBack(segments=segments)
                # the read-ahead's share reserved; then, where the pending write-backs do not
                # fit beside it, theirs too
                for reserve in dict.fromkeys((extra, extra + (segments or 0) * largest)):
                    p = _fill_host(shape, train, hw, candidate.placements, order, keep, host,
                                   budgets, reserve=reserve, host_grads=host_grads,
                                   readahead=ra, writeback=wb, replays=replays)
                    if p.fits and p.step_s < best.step_s * 0.9999:
                        best = p
                    if p.fits:
                        break
    return best


def _device_over(p: Plan) -> int:
    return max(0, p.device_total_bytes - p.budgets["device"])


def _overshoot(p: Plan) -> float:
    b = p.budgets
    return (max(0, p.device_total_bytes - b["device"]) + max(0, p.host_peak_bytes - b["host"])
            + max(0, p.disk_bytes - b["disk"]) + max(0, p.remote_bytes - b.get("remote", 0)))


def _host_then_disk(
    shape: ModelShape, placements, budgets, precision: str = "fp32", parked: int = 0,
    host_grads: bool = False, extra: int = 0,
    ring_bytes: Callable[[list[SegmentPlacement]], int] = lambda placements: 0,
) -> list[SegmentPlacement]:
    """Give host RAM to non-device state (and its compute copy, in bf16/fp8) while it fits;
    spill the last blocks first (their update is needed last by the next forward, so disk
    latency hides best there). With a memory node (a "remote" budget), a spilled segment's
    master and slots go to the node while its memory holds them (host RAM keeps its gradient
    and compute copy), then to disk; where host RAM is still short once every segment is
    spilled, remote ones go on to disk in the same order. `host_grads`: a spilled segment
    keeps its gradient in host RAM (no gradient byte touches the disk); `parked`: host bytes
    reserved for other uses; `extra`: segments spilled, in the same order, beyond those this
    estimate spills (the estimate leaves out staging only the replay knows: `_fill_host`
    backs off by it);
    `ring_bytes`: the gradients' landing ring under a placement, held beside the state through
    the sweep, less what of `parked` it is not held beside (the estimate then also checks
    the state and the ring together: a lower bound of the replay's peak)."""
    placements = [
        p if p.state_tier == Tier.DEVICE else SegmentPlacement(p.resident, Tier.HOST)
        for p in placements
    ]
    grad_tier = Tier.HOST if host_grads and not shape.frozen else None
    held = [_host_held_bytes(shape, i, precision) for i in range(len(shape.numels))]
    host_state = parked + sum(
        h for h, p in zip(held, placements, strict=True) if p.state_tier == Tier.HOST)

    def staging(i: int) -> int:  # one disk update + one streamed read in flight
        wire = shape.wire_bytes(i, precision)
        # the engine's loader: fp32 state streams through chunks, a compute copy is staged whole
        read = load_bytes(Tier.DISK, shape.numels[i], wire, STAGING_CHUNK_NUMEL).staging_bytes
        return shape.update_staging(i, wire, host_grad=grad_tier is not None) + read

    node_room = None if shape.frozen or "remote" not in budgets else (
        budgets["remote"] - NODE_STAGING_BYTES)  # less its receive staging
    spilled = 0
    for i in _spill_order(shape) * (1 if node_room is None else 2):
        if host_state + spilled <= budgets["host"] and (
                host_state + ring_bytes(placements) <= budgets["host"]):
            if extra <= 0:
                break
            extra -= placements[i].state_tier == Tier.HOST
        p = placements[i]
        if p.state_tier != Tier.HOST:
            continue
        if node_room is not None and not p.remote and _node_bytes(shape, i, precision) <= (
                node_room):
            placements[i] = SegmentPlacement(p.resident, Tier.HOST, remote=True)
            host_state -= held[i] - _remote_host_bytes(shape, i, precision)
            node_room -= _node_bytes(shape, i, precision)
            continue
        placements[i] = SegmentPlacement(p.resident, Tier.DISK, grad_tier)
        host_state -= (_remote_host_bytes(shape, i, precision) if p.remote else held[i]) - (
            0 if grad_tier is None else GRAD_B * shape.numels[i])
        spilled = max(spilled, staging(i))
    return placements


def _node_bytes(shape: ModelShape, s: int, precision: str) -> int:
    """What segment `s` takes of a memory node (tierlm.runtime.state._remote_bytes): its fp32
    master and gradient sum, the optimizer's slots and the compute copy it encodes."""
    return (MASTER_B + GRAD_B) * shape.numels[s] + shape.optim_state_bytes[s] + (
        shape.wire_bytes(s, precision) or 0)


def _remote_host_bytes(shape: ModelShape, s: int, precision: str) -> int:
    """Host RAM a remote segment holds: its landed gradient and the compute copy the stream
    uploads from (its fp32 weights where it has none)."""
    copy = shape.wire_bytes(s, precision)
    return GRAD_B * shape.numels[s] + (MASTER_B * shape.numels[s] if copy is None else copy)


@functools.lru_cache(maxsize=4096)
def _segment_ring_numel(n_segments: int, micro_batches: int, order: str, frozen: bool, s: int,
                        p: SegmentPlacement, numel: int) -> int:
    """Elements of the landing ring segment `s`'s own gradient landings need under placement
    `p` (tierlm.runtime.schedule.landing_ring_numel over its landings alone): the step's ring
    is the largest of these."""
    if not transient_grad(p.state_tier, frozen):
        return 0
    landings: list = [None] * n_segments
    landings[s] = (p.state_tier, p.gradient_tier, numel)
    actions = step_schedule(n_segments, micro_batches, order, first_trained=not frozen)
    return landing_ring_numel(actions, micro_batches, landings, STAGING_CHUNK_NUMEL)


def _spill_order(shape: ModelShape) -> list[int]:
    """The order in which `_host_then_disk` moves segments' state from host RAM to disk: the
    head, then the blocks from the last one back, the embedding last."""
    last = len(shape.names) - 1
    order = [i for i in range(last + 1) if shape.names[i] != "head"][::-1]
    return [last] + order if shape.names[last] == "head" else order


def _host_held_bytes(shape: ModelShape, s: int, precision: str) -> int:
    """Host RAM that segment `s`'s state (and its compute copy, in bf16/fp8) holds there."""
    return shape.state_bytes(s) + (shape.wire_bytes(s, precision) or 0)


def _fill_host(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, device_choice, order: str,
    keep: bool, host: bool, budgets: dict[str, int], *, reserve: int = 0,
    host_grads: bool = False, readahead: ReadAhead | None = None,
    writeback: WriteBack | None = None, replays: dict | None = None,
) -> Plan:
    """The plan of `device_choice` (which segments are resident, which keep their state on the
    device) with the rest of the state in host RAM as far as the replay says it fits, the
    remainder on disk. `_host_then_disk` spills by an estimate (held state plus one update's
    and one read's staging); the replay also counts what only the engine's walk shows (the
    gradients' landing ring, a forward's read beside an update's chunks, the boundary inputs
    parked meanwhile, pending write-backs), so while the replayed host peak is over the
    budget one segment more goes to disk, in the same order. `reserve`: host bytes kept free
    for the read-ahead and the write-back; `replays`: a cache of `_replay`s by placement and
    read-ahead, shared by callers that try several write-backs on one sweep."""
    replays = {} if replays is None else replays
    parked = parked_bytes(shape, train, order, host) + reserve
    segments = (len(shape.names), train.micro_batches, order, shape.frozen)

    def ring_bytes(placements: list[SegmentPlacement]) -> int:  # the replay's own rule
        # held beside the state, not beside the parked inputs and reserves (the backward that
        # lands gradients frees the parked inputs as it goes), so those are taken off
        return GRAD_B * max(_segment_ring_numel(*segments, s, p, shape.numels[s])
                            for s, p in enumerate(placements)) - parked

    def placed(extra: int) -> tuple[list[SegmentPlacement], Plan]:
        trial = _host_then_disk(shape, device_choice, budgets, train.precision, parked,
                                host_grads, extra, ring_bytes)
        key = (tuple(trial), order, keep, host, readahead)
        if key not in replays:
            replays[key] = _replay(shape, train, trial, order, keep, host, STAGING_CHUNK_NUMEL,
                                   readahead)
        return trial, _evaluate(shape, train, hw, trial, order, keep, budgets, host,
                                readahead=readahead, writeback=writeback, replay=replays[key])

    over_at = -1  # the most extra spills known to overshoot
    extra = 0
    while True:
        trial, p = placed(extra)
        over = p.host_peak_bytes - budgets["host"]
        if over <= 0 or not any(pl.state_tier == Tier.HOST for pl in trial):
            break
        over_at = extra
        # spill the next segments, in order, until the bytes they free cover the overshoot
        # (at least one; what they stage instead the replay checks)
        freed = 0
        for i in _spill_order(shape):
            if trial[i].state_tier == Tier.HOST and freed < over:
                extra += 1
                freed += _host_held_bytes(shape, i, train.precision) - (
                    GRAD_B * shape.numels[i] if host_grads and not shape.frozen else 0)
    # the jump may spill more than needed (a spill frees more than its state: staging and
    # write-backs with it): the fewest spills between that fit
    while p.host_peak_bytes <= budgets["host"] and extra - over_at > 1:
        mid = (over_at + extra) // 2
        _, q = placed(mid)
        if q.host_peak_bytes <= budgets["host"]:
            extra, p = mid, q
        else:
            over_at = mid
    return p

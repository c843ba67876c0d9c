"""One candidate placement evaluated: its peak bytes per tier from the byte replay
(tierlm.runtime.byte_replay), its step time from the time model (tierlm.plan.timing) and, for the
variants that fit, from the simulated step (tierlm.plan.replay)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from tierlm.memory.arena import ArenaReplay
from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import (
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    SegmentPlacement,
    staging_numel,
)
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.node.transport import CHUNK_BYTES, INFLIGHT
from tierlm.plan.offload_bytes import offload_sizes, offload_workspace_bytes
from tierlm.plan.replay import ReplayConfig, simulate_step
from tierlm.plan.replay_parts import StepTiming
from tierlm.plan.result import Plan, _problems
from tierlm.plan.timing import _bottleneck, _times, compiled_block_factor, writeback_bytes
from tierlm.runtime import schedule
from tierlm.runtime.byte_replay import _compute_copies, _simulate, readahead_schedule
from tierlm.runtime.schedule import MOST_HELD_GRADIENTS, micro_batches_in_flight
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.runtime.state import persistent_bytes
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, WriteBack

if TYPE_CHECKING:
    from tierlm.runtime.readahead import ReadAhead

NODE_STAGING_BYTES = INFLIGHT * CHUNK_BYTES  # a memory node's receive staging


def evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host=False, *,
             chunk_numel: int = STAGING_CHUNK_NUMEL, readahead: ReadAhead | None = None,
             writeback: WriteBack | None = DEFAULT_WRITEBACK,
             offload: tuple[bool, ...] = ()) -> Plan:
    """Predict memory and time for one given placement (the planner's inner step; also used to
    predict runs whose placement the user chose; `chunk_numel`: the engine's
    staging_chunk_numel; `readahead`: its update read-ahead; `writeback`: its deferred
    write-back; `offload`: per segment, those whose saved tensors wait in host RAM)."""
    return _evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host,
                     chunk_numel=chunk_numel, readahead=readahead, writeback=writeback,
                     offload=offload)


def _update_overlap_bytes(
    shape: ModelShape, placements: list[SegmentPlacement], copies: list[int | None],
    chunk_numel: int = STAGING_CHUNK_NUMEL, *, read_ahead: frozenset[int] = frozenset(),
    parked_per_block: int = 0, pending_bytes: int = 0,
) -> int:
    """Host staging while the background update overlaps the next forward. Updates run in
    forward order; the forward of segment a waits for a's update, then reads a's weights
    (disk: through staging chunks) while the worker updates the next segment b (disk: chunks of
    master, gradient and the optimizer's slots staged). The read-ahead's buffers of b and of
    every segment after it are still held (each is freed once its update has written it back),
    and the forward has parked the boundary inputs of the blocks up to a + 1 on the host
    (`parked_per_block`: one block's, for the micro-batches of the first group); with a
    deferred write-back, `pending_bytes` of earlier segments' master and slots may still wait
    to be written. So the peak is the worst such pair."""
    order = [i for i, p in enumerate(placements) if p.state_tier != Tier.DEVICE]
    last = len(placements) - 1

    def read(i: int) -> int:  # the compute file, or the fp32 master in chunks
        if placements[i].state_tier != Tier.DISK:
            return 0
        return (MASTER_B * staging_numel(shape.numels[i], chunk_numel) if copies[i] is None
                else copies[i])

    def update(i: int) -> int:  # master, gradient, slots; the compute copy it encodes
        if placements[i].state_tier != Tier.DISK:
            return 0
        held = sum(shape.update_state_bytes(j) for j in read_ahead if j >= i)
        return pending_bytes + held + shape.update_staging(i, copies[i], chunk_numel,
                                           host_grad=placements[i].host_grad,
                                           read_ahead=i in read_ahead)

    def parked(a: int) -> int:  # boundary inputs of blocks 1 .. a + 1
        return parked_per_block * max(0, min(a + 1, last - 1))

    pairs = [update(order[0])] if order else [0]
    pairs += [parked(a) + read(a) + update(b) for a, b in zip(order, order[1:], strict=False)]
    return max(pairs)


def _evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host=False, *,
              chunk_numel: int = STAGING_CHUNK_NUMEL, readahead: ReadAhead | None = None,
              writeback: WriteBack | None = DEFAULT_WRITEBACK, replay=None,
              offload: tuple[bool, ...] = ()) -> Plan:
    """`replay`: this placement's `_replay` when the caller has it (the write-back options
    change neither the sweep's bytes nor its ledger); `offload`: per segment, those whose saved
    tensors wait in host RAM (tierlm.plan.offload; not with `replay`)."""
    ledger, workspace, read_ahead, arena = replay or _replay(
        shape, train, placements, order, keep, boundary_host, chunk_numel, readahead,
        offload_sizes(shape, train, offload))
    workspace += offload_workspace_bytes(shape, train, offload, order)
    device_peak = ledger.peak_tier_bytes[Tier.DEVICE]
    host_persistent = ledger.tier_bytes(Tier.HOST)
    first_group = train.micro_batches if order == "layer-outer" else 1
    copies = _compute_copies(shape, train.precision, placements)
    # The write-back's staging outlives the update: up to `segments` of them may wait while
    # the next sweep runs (on top of its ledger peak), one fewer while an update stages.
    pending = sorted(writeback_bytes(shape, placements, copies, writeback, chunk_numel).values(),
                     reverse=True)
    limit = 0 if writeback is None else writeback.segments
    host_peak = max(ledger.peak_tier_bytes[Tier.HOST] + sum(pending[:limit]),
                    host_persistent + _update_overlap_bytes(
                        shape, placements, copies, chunk_numel,
                        read_ahead=frozenset(read_ahead),
                        parked_per_block=parked_bytes(shape, train, order, boundary_host)
                        // max(1, len(shape.names) - 2),
                        pending_bytes=sum(pending[:max(0, limit - 1)])))
    moved = {link.value: ledger.total_moved_bytes[link] for link in Link}
    times = _times(shape, train, hw, placements, keep, moved, read_ahead=frozenset(read_ahead),
                   groups=train.micro_batches // first_group, writeback=writeback,
                   chunk_numel=chunk_numel)

    def by_class(tier: Tier) -> dict[str, int]:
        return {c.value: ledger.peak_class_bytes[(tier, c)] for c in TensorClass
                if ledger.peak_class_bytes[(tier, c)]}

    plan = Plan(
        placements=placements, order=order, keep_resident_activations=keep,
        device_peak_bytes=device_peak, host_peak_bytes=host_peak,
        disk_bytes=ledger.tier_bytes(Tier.DISK),
        device_by_class=by_class(Tier.DEVICE), host_by_class=by_class(Tier.HOST),
        disk_by_class=by_class(Tier.DISK), workspace_bytes=workspace, moved_bytes=moved,
        times_s=times, bottleneck=_bottleneck(times),
        tokens_per_s=train.tokens_per_step / times["step"], budgets=budgets,
        names=shape.names, numels=shape.numels, boundary_on_host=boundary_host,
        readahead=readahead, readahead_segments=read_ahead, writeback=writeback,
        pinned_peak_bytes=ledger.pinned_peak_bytes, pinned_arena_bytes=arena.total_bytes,
        pinned_by_class={c.value: ledger.pinned_class_peak_bytes[c] for c in TensorClass
                         if ledger.pinned_class_peak_bytes[c]},
        remote_bytes=remote_held_bytes(ledger.peak_tier_bytes[Tier.REMOTE]),
        offload_graphs=tuple(offload) if any(offload) else (),
    )
    plan.problems = _problems(plan, budgets)
    plan.fits = not plan.problems
    return plan


def remote_held_bytes(state_bytes: int) -> int:
    """What a memory node holding `state_bytes` of the run's state takes of its RAM: with its
    receive staging (tierlm.node.server: chunks in flight), as the node counts it when it
    admits a session."""
    return state_bytes + NODE_STAGING_BYTES if state_bytes else 0


def _replay(shape, train, placements, order, keep, boundary_host, chunk_numel, readahead,
            offloaded=(), speculative=False, held_gradients=1):
    """The sweep's replay (ledger, workspace), the segments it reads ahead and the pinned arena
    it needs (`offloaded`: the offload policy's host buffers per segment; `speculative`: with
    speculative disk-tier updates keeping up to `held_gradients` gradients in host RAM)."""
    arena = ArenaReplay()
    ledger, workspace, _ = _simulate(shape, train, placements, order, keep, boundary_host,
                                     chunk_numel=chunk_numel, readahead=readahead, arena=arena,
                                     offloaded=offloaded, speculative=speculative,
                                     held_gradients=held_gradients)
    read_ahead = [s for segs in readahead_schedule(
        shape, train, placements, order, boundary_host, readahead,
        speculative=speculative).values() for s in segs]
    return ledger, workspace, read_ahead, arena.pinned_bytes()


SIMULATED_LANES = {"compute": "compute", "h2d": "H2D", "d2h": "D2H", "disk": "disk",
                   "cpu_update": "cpu update", "cpu_adds": "cpu"}
# with a memory node: the link each way and the node's CPU
NODE_LANES = {"net_send": "net send", "net_recv": "net recv", "node_cpu": "node cpu"}


def simulated_lanes(hw: HardwareProfile) -> dict[str, str]:
    """The simulated lanes a plan on `hw` reports (`simulated_<key>` in `times_s`)."""
    return SIMULATED_LANES if hw.memory_node is None else {**SIMULATED_LANES, **NODE_LANES}


def replay_plan(shape: ModelShape, train: TrainShape, hw: HardwareProfile, p: Plan
                ) -> StepTiming:
    """`p`'s step replayed on a timing device (tierlm.plan.replay.simulate_step), as every
    user of the simulated step runs it: `simulated_times` and the predicted trace
    (tierlm.plan.timeline)."""
    return simulate_step(shape, train, p.placements, p.order, p.keep_resident_activations,
                         p.boundary_on_host,
                         ReplayConfig(hw=hw, speculative_disk_updates=p.speculative,
                                      held_gradients=p.held_gradients),
                         readahead=p.readahead,
                         writeback=p.writeback,
                         offloaded=offload_sizes(shape, train, p.offload_graphs))


def simulated_times(shape: ModelShape, train: TrainShape, hw: HardwareProfile, p: Plan
                    ) -> dict[str, float]:
    """`p`'s steady-state step as the replay simulates it (tierlm.plan.replay: the engine's
    operations on a timing device, two steps, the second's), for `times_s`: the step, each
    lane's busy time in it (`simulated_<lane>`) and each copy lane's busy time under compute
    (`simulated_<lane>_overlap`). Run for the chosen plan only: the search still ranks
    candidates by `_times` (a replay in virtual time costs ~0.3-2 s at 7B; the search
    evaluates thousands of candidates)."""
    r = replay_plan(shape, train, hw, p)
    out = {"simulated_step": r.step_s, "simulated_transfer_wait": r.transfer_wait_s}
    for key, lane in simulated_lanes(hw).items():
        out[f"simulated_{key}"] = r.lane_busy_s.get(lane, 0.0)
    for key in ("h2d", "d2h", "disk"):
        out[f"simulated_{key}_overlap"] = r.overlap_s.get(SIMULATED_LANES[key], 0.0)
    return out


def spare_disk_bytes(shape: ModelShape, train: TrainShape,
                     placements: list[SegmentPlacement]) -> dict[str, int]:
    """By class, the disk bytes of speculative updates' second set of files (master, slots and
    compute copy of each disk-tier segment that trains: `persistent_bytes(..., spare=True)`
    beyond the first set, as the engine's `reserve_spare` reserves them)."""
    if shape.frozen:
        return {}
    copies = _compute_copies(shape, train.precision, placements)
    out: dict[str, int] = {}
    for s, p in enumerate(placements):
        if p.state_tier != Tier.DISK:
            continue
        args = (p, shape.numels[s], shape.optim_state_bytes[s], copies[s])
        first = persistent_bytes(*args)
        for _, cls, nbytes in persistent_bytes(*args, spare=True)[len(first):]:
            out[cls.value] = out.get(cls.value, 0) + nbytes
    return out


def with_speculation(shape: ModelShape, train: TrainShape, hw: HardwareProfile, p: Plan
                     ) -> Plan:
    """`p` with speculative disk-tier updates: the spare files in its disk bytes (and its
    budget check; by class as one class of their own, `spare`: the other classes stay each
    segment's one copy), the speculations' staging during the backward and the gradients kept
    for them in its host peak, its moves without the gradient files they no longer read, its
    simulated step the replay's with the engine's speculation. They keep up to
    MOST_HELD_GRADIENTS gradients in host RAM where the host budget holds them, else one."""
    spare = sum(spare_disk_bytes(shape, train, p.placements).values())
    # Host: the speculations stage on the update worker during the backward, one at a time,
    # beside the write-backs still pending: one update's staging (the largest disk-tier
    # segment's) on top of the sweep's peak and the limit's largest write-backs. Each takes
    # its gradient from host RAM (held on the host, or kept there by its final landing: the
    # sweep's replay holds those as the engine does), never staged from its file.
    copies = _compute_copies(shape, train.precision, p.placements)
    pending = sorted(writeback_bytes(shape, p.placements, copies, p.writeback).values(),
                     reverse=True)
    limit = 0 if p.writeback is None else p.writeback.segments
    staging = max((shape.update_staging(s, copies[s], host_grad=True)
                   for s, pl in enumerate(p.placements) if pl.state_tier == Tier.DISK),
                  default=0)
    for held in range(MOST_HELD_GRADIENTS, 0, -1):
        ledger = _replay(shape, train, p.placements, p.order, p.keep_resident_activations,
                         p.boundary_on_host, STAGING_CHUNK_NUMEL, p.readahead,
                         offload_sizes(shape, train, p.offload_graphs), speculative=True,
                         held_gradients=held)[0]
        sweep = ledger.peak_tier_bytes[Tier.HOST] + sum(pending[:limit])
        q = replace(p, speculative=True, held_gradients=held, disk_bytes=p.disk_bytes + spare,
                    disk_by_class={**p.disk_by_class, "spare": spare}, times_s=dict(p.times_s),
                    moved_bytes={link.value: ledger.total_moved_bytes[link] for link in Link},
                    host_peak_bytes=max(p.host_peak_bytes, sweep + staging), problems=[])
        q.problems = _problems(q, q.budgets)
        q.fits = not q.problems
        if q.host_peak_bytes <= q.budgets["host"]:
            break
    q.times_s.update(simulated_times(shape, train, hw, q))
    return q


def parked_bytes(shape: ModelShape, train: TrainShape, order: str, on_host: bool) -> int:
    """Host bytes of the boundary activations parked there at the forward's end: the inputs
    the engine parks when every block recomputes (tierlm.runtime.schedule.parked_inputs: every
    block's; the head's is used at once), for the micro-batches in flight."""
    # the engine's rule, read from its module at each call (a test changes it there)
    parked = schedule.parked_inputs(["full"] * (len(shape.names) - 1), on_host)
    return micro_batches_in_flight(train.micro_batches, order) * len(parked) * \
        train.batch_size * train.seq_len * shape.hidden_size * 4


# what each simulated lane is called when it sets the step
_LANE_BOTTLENECK = {"compute": "compute", "h2d": "PCIe (H2D/D2H)", "d2h": "PCIe (H2D/D2H)",
                    "disk": "disk", "cpu_update": "CPU optimizer update",
                    "cpu_adds": "CPU gradient adds", "net_send": "network to the memory node",
                   "net_recv": "network from the memory node",
                   "node_cpu": "the memory node's optimizer update"}


def simulation_gap(shape: ModelShape, train: TrainShape, hw: HardwareProfile) -> str | None:
    """What of the plan's step the simulated timeline does not price yet (None: all of it). The
    simulator has no network lane (the context-parallel ring, the gradient sync across ranks),
    no NF4 decode pass and no compiled blocks' measured speedup: for such plans the prediction
    stays the closed-form estimate (`tierlm.plan.timing`), which prices them."""
    if train.nproc > 1 or train.context_parallel > 1:
        return "the network between ranks"
    if shape.base_nf4_numels:
        return "the NF4 decode"
    if compiled_block_factor(train, hw) != 1.0:
        return "the compiled blocks' measured speedup"
    return None


def adopt_simulated(p: Plan, train: TrainShape) -> None:
    """Make `p`'s prediction its simulated step (`simulated_times` already in `p.times_s`): the
    step, tokens/s, the bottleneck (the busiest lane) and the bound it is compared with (the
    simulated compute). The closed-form estimate the search grew the placement by is kept as
    `times_s["estimate"]`."""
    t = p.times_s
    t["estimate"] = t["step"]
    t["step"] = t["simulated_step"]
    p.tokens_per_s = train.tokens_per_step / t["step"]
    busy = {key: t[f"simulated_{key}"] for key in _LANE_BOTTLENECK if f"simulated_{key}" in t}
    p.bottleneck = _LANE_BOTTLENECK[max(busy, key=busy.get)]  # type: ignore[arg-type]

"""The planner's keep / offload / recompute choice per streamed segment.

After the keep flags (`search._keep_streamed`: streamed blocks keep their graph where the device
has room), the blocks that would still recompute may instead hold their saved tensors in host
RAM (the `offload` activation policy, tierlm.activations.offload): copied to the host after each
forward on the D2H engine, back ahead of the backward on the H2D engine. That saves the
recompute (a third of a block's backward FLOPs) at the price of the copies: it pays where the
links have slack under the compute, which only the simulated step can tell (the copies share the
H2D engine with the weights streamed in, and the backward waits for them). So the planner
offloads the last such blocks first (their backward comes first: their buffers are held the
shortest), as many as host RAM holds (the budget the plan leaves, its pinned arena included),
and keeps that choice, or fewer of them, only where the replay of the engine's step
(tierlm.plan.replay) runs faster than with every one of them recomputing.

The byte model: one micro-batch's offloaded buffers of a block are its saved storages (one
block run on fake tensors, as tierlm.runtime.shapes measures it), cut from the pinned arena at
the forward and given back after the backward (tierlm.runtime.byte_replay counts them in the host
ledger and the arena); on the device, a backward holds its own saved tensors brought back and
the next offloaded segment's on their way (tierlm.plan.offload_bytes). The engine measures the
exact buffers once before the first step (tierlm.runtime.pinned.offload_sizes) and sizes its
arena by them.
"""

from __future__ import annotations

from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import keeps_graph
from tierlm.plan.evaluate import _evaluate, simulated_times, simulation_gap
from tierlm.plan.result import Plan
from tierlm.runtime.shapes import ModelShape, TrainShape


def _fits_with_arena(p: Plan) -> bool:
    """`p` fits, its pinned arena's slack (what the order of allocations leaves unusable
    between buffers) counted in host RAM too."""
    slack = max(0, p.pinned_arena_bytes - p.pinned_peak_bytes)
    return p.fits and p.host_peak_bytes + slack <= p.budgets["host"]


def offload_streamed(shape: ModelShape, train: TrainShape, hw: HardwareProfile,
                     candidate: Plan, budgets: dict[str, int]) -> Plan:
    """`candidate` with the blocks it recomputes offloaded where that pays (the module's
    docstring): the most that host RAM and the device hold, then half as many, a quarter, ...,
    each simulated; the fastest simulated step wins, `candidate` on ties. The offloaded blocks'
    copies coming back hold one more block's saved tensors on the device in the backward,
    which a device full of kept graphs has no room for: the earliest streamed block that keeps
    its graph is also tried offloaded instead. Not for candidates that recompute every segment
    or park boundary inputs on the host (an offloaded graph holds its input on the device), a
    LoRA base (its streamed segments recompute: tierlm.runtime.plan), plans whose step the
    simulator does not price (`simulation_gap`), nor a CPU profile (its device tier is host
    RAM: an offload would move saved tensors from RAM to RAM)."""
    if (not candidate.fits or candidate.keep_resident_activations is False
            or candidate.boundary_on_host or shape.frozen or hw.device_is_cpu
            or simulation_gap(shape, train, hw) is not None):
        return candidate
    n = len(shape.names)
    keep = keeps_graph(candidate.placements, candidate.keep_resident_activations)
    kept = [s for s in range(1, n - 1) if keep[s] and not candidate.placements[s].resident]
    best, best_s = candidate, None
    for dropped in ([], kept[:1]):  # the earliest kept streamed block given up, or none
        flags = tuple(k and s not in dropped for s, k in enumerate(keep))
        recomputed = [s for s in reversed(range(1, n - 1)) if not flags[s]]  # last first
        if not recomputed or (dropped and not kept):
            continue
        trials: dict[int, Plan] = {}

        def trial(k: int, flags=flags, recomputed=recomputed, trials=trials) -> Plan:
            if k not in trials:  # the last k recomputed blocks offloaded
                chosen = set(recomputed[:k])
                trials[k] = _evaluate(shape, train, hw, candidate.placements, candidate.order,
                                      flags, budgets, candidate.boundary_on_host,
                                      readahead=candidate.readahead,
                                      writeback=candidate.writeback,
                                      offload=tuple(s in chosen for s in range(n)))
            return trials[k]

        # the most that fit (the bytes grow with each block offloaded)
        lo, hi = 0, len(recomputed)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits_with_arena(trial(mid)):
                lo = mid
            else:
                hi = mid - 1
        if best_s is None and lo:
            best_s = simulated_times(shape, train, hw, candidate)["simulated_step"]
        k = lo
        while k >= 1:
            p = trial(k)
            p.times_s.update(simulated_times(shape, train, hw, p))
            if p.times_s["simulated_step"] < best_s:
                best, best_s = p, p.times_s["simulated_step"]
            k //= 2
    return best

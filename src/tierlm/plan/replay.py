"""The planner's step in virtual time: its replay of the engine's walk issues the engine's
operations to a `TimingDevice` (tierlm.memory.device), so the predicted step is the simulated
one (one time model, as there is one byte model).

The replay (tierlm.runtime.byte_replay._CountingStep, over byte counts) walks the engine's own walk
(tierlm.runtime.walk), through the engine's own stream cache, loaders (tierlm.runtime.state
start_load: HostLoad, WireLoad, DiskLoad, ComputeFileLoad), gradient landing
(tierlm.runtime.landing.add_to_host) and disk chunking (tierlm.runtime.state.stream_chunks),
run on counting tensors (`planner._Bytes`) and a store whose device books every copy, wait, disk
request and CPU price on a timeline instead of touching memory. What the engine does in its own
methods, this module does in the same order with the same names: the compute regions priced by
tierlm.runtime.costs.SegmentCost as `Engine._forward`, `_head` and `_backward` price them, the
step's one host read (the global norm), and the update (`Engine._finish_step`, `_update`,
`_update_disk`): device-tier updates as zero-FLOP compute regions, the others on the update
worker, inline on its own host clock, CPU priced at `numel x optimizer cpu_cost` parameters.

Segments whose activations are offloaded (`offloaded`: per segment, the host buffers the
`offload` policy takes for one micro-batch, in order; tierlm.activations.offload) copy their
saved tensors to the host after each forward's compute (on the D2H engine), and back ahead of
their backward when the action before it begins (on the H2D engine, each after its copy out and
the compute queued so far), the backward waiting for the last of them: the engine's
`Offload.forward_done`, `bring_back` and `backward`.

Resident copies an update made stale are refreshed while the action before their first use
runs, where that update is done (`refresh_ahead`: Engine._refresh_ahead), and parked boundary
inputs come back one micro-batch ahead of their backward (the walk's `bring_back_next`; `unpark`,
`arrived` and `release_parked` as `_TensorStep`'s).

`simulate_step` runs two steps on one timeline: the first fills the stream cache and runs its
update, the second is the steady state. tests/plan/test_replay.py holds the replay's
operations equal to the engine's on `SimDevice` for the configurations it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from tierlm.config import OptimConfig
from tierlm.memory.device import TimingDevice
from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import (
    GRAD_B,
    STAGING_CHUNK_NUMEL,
    KeepGraphs,
    SegmentPlacement,
    chunk_ranges,
    keeps_graph,
)
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.optim import build_flat_optimizer
from tierlm.plan.replay_parts import StepTiming, _State, _timing, _timing_store
from tierlm.runtime import schedule
from tierlm.runtime.byte_replay import (
    _actions,
    _Bytes,
    _compute_copies,
    _CountingStep,
    _stream_plan,
    readahead_schedule,
)
from tierlm.runtime.cache import StreamCache, window_bytes
from tierlm.runtime.costs import SegmentCost
from tierlm.runtime.landing import LandingRing, add_to_host
from tierlm.runtime.schedule import (
    grad_landing,
    held_before,
    keeps_landed_grad,
    landing_ring_numel,
    transient_grad,
)
from tierlm.runtime.state import (
    CopiesRead,
    read_copies,
    refresh_due,
    refresh_resident,
    reload_resident,
    start_load,
    stream_chunks,
    write_back_copies,
)
from tierlm.runtime.walk import StepRules, walk_step
from tierlm.runtime.writeback import Writer, deferred_copies

STEPS = 2  # the first fills the stream cache and runs the update the second waits for


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """What the timed replay needs beyond the byte replay's arguments."""

    hw: HardwareProfile  # the rates (the precision and --tf32: the TrainShape's)
    chunk_numel: int = STAGING_CHUNK_NUMEL
    direct: bool = True  # the disk tier moves whole 4 KiB blocks (O_DIRECT)
    steps: int = STEPS
    # The engine's speculative updates (EngineOptions.speculative_updates): each disk-tier
    # segment's update issued at its gradient's final landing into its spare file generation,
    # kept once the norm is read; the replay takes the clipping coefficient as 1 (each one
    # kept: the commit moves nothing).
    speculative_disk_updates: bool = False
    held_gradients: int = 1  # EngineOptions.held_gradients


def simulate_step(shape, train, placements: list[SegmentPlacement], order: str,
                  keep_resident: KeepGraphs, boundary_host: bool, config: ReplayConfig, *,
                  readahead=None, writeback=None,
                  offloaded: Sequence[Sequence[int]] = ()) -> StepTiming:
    """`config.steps` steps of the engine on `placements`, replayed over byte counts on a
    `TimingDevice`; the last one's timing. `offloaded`: per segment but the head, the host
    buffers (bytes, in order) its `offload` policy takes per micro-batch (() where it does
    not offload: it keeps or recomputes as `keep_resident` says)."""
    dev = TimingDevice(config.hw, train.precision, tf32=train.tf32)
    ledger = Ledger()
    store = _timing_store(ledger, dev, config.direct)
    chunk = config.chunk_numel
    n = len(shape.names)
    last = n - 1
    frozen = shape.frozen
    # each segment's compute copy off the device (a frozen base's own copy included)
    copies = _compute_copies(shape, train.precision, placements)
    optimizer = build_flat_optimizer(shape.optim_config or OptimConfig())
    slots = () if frozen else tuple(optimizer.slots)
    params = shape.param_numels or [((name, numel),) for name, numel in
                                    zip(shape.names, shape.numels, strict=True)]
    states = [_State(s, shape.names[s], params[s], p, copies[s], slots)
              for s, p in enumerate(placements)]
    costs = [SegmentCost(params=shape.numels[s] + (shape.tied_numel if s == last else 0),
                         block=0 < s < last, frozen=frozen) for s in range(n)]
    tokens = train.batch_size * train.seq_len
    keep = keeps_graph(placements, keep_resident)
    sizes = [tuple(offloaded[s]) if s < len(offloaded) else () for s in range(n)]
    # the engine's policy names (tierlm.runtime.plan: kept graphs, offloaded ones, recomputed)
    policy = ["keep" if keep[s] else "offload" if sizes[s] else "full" for s in range(n)]
    hidden = tokens * shape.hidden_size
    worker = dev.worker("update")
    lander = dev.worker("landing", overlaps_device=True)  # Engine._lander
    writer = Writer(store, (writeback.segments if writeback is not None else 1))
    updates: dict[int, Future] = {}
    ahead_reads: dict[int, Any] = {}
    speculated: dict[int, tuple[Future, _State]] = {}  # Engine._speculated
    kept: list[Future] = []  # Engine._kept

    cache = StreamCache(store, lambda s: states[s].device_nbytes(),
                        window_bytes(states[s].device_nbytes() for s, p in enumerate(placements)
                                     if not p.resident),
                        lambda s: start_load(store, states[s], chunk),
                        ready=lambda s: s not in updates or updates[s].done(),
                        reusable=lambda s: s >= last or policy[s] == "full")
    actions = _actions(shape, train, order)
    ahead = readahead_schedule(shape, train, placements, order, boundary_host, readahead,
                               actions, speculative=config.speculative_disk_updates)
    landings = [(p.state_tier, p.gradient_tier, shape.numels[s])
                if transient_grad(p.state_tier, frozen) else None
                for s, p in enumerate(placements)]
    ring_numel = landing_ring_numel(actions, train.micro_batches, landings, chunk)
    tied_owners = [0] if shape.tied_numel else []
    rules = StepRules(
        micro_batches=train.micro_batches,
        # the engine's rule, read from its module at each call (a test changes it there)
        parked=schedule.parked_inputs(policy[:last], boundary_host),
        tied_owners=tied_owners, tied_trained=bool(tied_owners) and not frozen,
        state_tiers=[p.state_tier for p in placements], first_trained=not frozen)

    def wait_update(s: int) -> None:  # Engine._wait_update
        fut = updates.pop(s, None)
        if fut is not None:
            fut.result()

    class TimedStep(_CountingStep):
        """The byte replay's backend with the engine's operations on the timing device."""

        # (micro-batch, segment) -> its offloaded storages: [host buffer, copy out's event,
        # copy back's event (None until brought back)], in the order the forward saved them
        off: dict[tuple[int, int], list[list]]

        def begin(self, k: int, a: Any) -> None:  # _TensorStep.begin: Engine._bring_back
            super().begin(k, a)
            for b in self.actions[k + 1:k + 2]:
                if b.kind == "bwd":
                    for i in b.mbs:
                        self.bring_back(i, b.seg)

        def bring_back(self, i: int, s: int) -> None:
            self.bring_back_all(self.off.get((i, s), []))

        def weights(self, k: int, s: int) -> None:  # Engine._weights
            wait_update(s)
            st = states[s]
            if not st.placement.resident:
                self.cache.acquire(k, s)
            elif st.device_stale:
                reload_resident(store, st, chunk, self.refreshing.pop(s, None))
                st.device_stale = False

        def refresh_ahead(self, k: int) -> None:  # Engine._refresh_ahead
            for s in schedule.reads(self.actions[k], tied_owners):
                st = states[s]
                if s not in self.refreshing and refresh_due(st, updates.get(s)):
                    load = refresh_resident(store, st, chunk)
                    if load is not None:
                        self.refreshing[s] = load

        def prefetch(self, k: int) -> None:  # _TensorStep.prefetch
            self.cache.reads_done(k - 1)
            super().prefetch(k)

        def drain(self) -> None:  # Engine._drain_landings
            if self.in_flight is not None:
                (fut, grad), self.in_flight = self.in_flight, None
                fut.result()
                store.free(Tier.DEVICE, TensorClass.GRAD, grad)

        def read_ahead(self, s: int) -> None:  # _TensorStep.read_ahead
            if s in speculated:
                return
            writer.wait(s)  # the last update's write-back of them has landed
            ahead_reads[s] = CopiesRead(store, states[s], states[s].state_copies)

        def forward(self, a: Any, w: None, xs: list):
            s = a.seg
            for i, _ in zip(a.mbs, xs, strict=True):  # each output is held (and parked)
                # before the next micro-batch runs
                with dev.compute(f"forward {shape.names[s]}",
                                 costs[s].forward(tokens, train.seq_len, shape.hidden_size),
                                 block=costs[s].block):
                    held = [store.alloc(Tier.HOST, TensorClass.ACTIVATION, nbytes, torch.uint8,
                                        pinned=True) for nbytes in sizes[s]]
                if held:  # OffloadScope.copy_out, once the forward's compute is issued
                    self.off[(i, s)] = [
                        [h, dev.copy(h, _Bytes(h.numel(), 1), Link.D2H, "offload"), None]
                        for h in held]
                    store.ledger.record_move(Link.D2H, sum(h.numel() for h in held))
                yield self.act

        def head(self, k, a, i, w, x, grad, tied):
            with dev.compute(f"head {shape.names[a.seg]}", costs[a.seg].head(tokens)):
                pass
            with dev.compute():  # the loss and the backward: priced with the forward above
                pass
            return self.act

        def backward(self, a, i, w, x, gout, grad):
            s = a.seg
            flops = costs[s].backward(tokens, train.seq_len, shape.hidden_size,
                                      recompute=policy[s] == "full")
            with dev.compute(f"backward {shape.names[s]}", flops, block=costs[s].block):
                copies = self.off.pop((i, s), [])
                if copies:  # Offload.backward: OffloadScope.arrive, then release
                    self.bring_back_all(copies)
                    dev.wait(copies[-1][2], "offload")
                    for c in copies:
                        store.free(Tier.HOST, TensorClass.ACTIVATION, c[0])
            return self.act

        def bring_back_all(self, copies: list[list]) -> None:  # OffloadScope.bring_back
            for c in copies:
                if c[2] is None:
                    c[2] = dev.copy(_Bytes(c[0].numel(), 1), c[0], Link.H2D, "offload",
                                    after=[c[1], dev.mark()])
                    store.ledger.record_move(Link.H2D, c[0].numel())

        def park(self, s: int, x):
            host = store.alloc(Tier.HOST, TensorClass.ACTIVATION, x.numel(), pinned=True)
            return host, store.to_host(host, x, f"boundary {shape.names[s]}")

        def wait_parked(self, copy) -> None:
            store.wait(copy[1])

        def unpark(self, s: int, copy):  # _TensorStep.unpark
            host, written = copy
            return self.act, store.to_device(_Bytes(hidden), host, f"boundary {shape.names[s]}",
                                             after=[written, dev.mark()])

        def arrived(self, s: int, event) -> None:
            store.wait(event, f"boundary {shape.names[s]}")

        def release_parked(self, copy) -> None:
            store.free(Tier.HOST, TensorClass.ACTIVATION, copy[0])

        def land(self, s: int, grad, final: bool) -> None:  # Engine._land_grad
            p = placements[s]
            st = states[s]
            if frozen or not transient_grad(p.state_tier, frozen):
                return
            what = f"grad {shape.names[s]}"
            path = grad_landing(p.state_tier, p.gradient_tier, written=st.grad_written,
                                final=final)
            dgrad = _Bytes(shape.numels[s])
            self.drain()
            if path.to_host:  # on the landing worker, one in flight
                self.ring.hold()
                done = dev.mark()
                self.in_flight = (lander.submit(add_to_host, store, self.ring, st.grad, dgrad,
                                                chunk, what, after=[done]), grad)
                self.speculate(s, final)
                return
            if path.ring_numel(st.numel, chunk):
                self.ring.hold()

            def file_pass(ps, keep=None) -> None:  # Engine._grad_file_chunks
                def step(lo: int, bufs: dict) -> None:
                    staging, d = bufs["grad"], dgrad.narrow(0, lo, bufs["grad"].numel())
                    if ps.add:
                        add_to_host(store, self.ring, staging, d, chunk, what)
                    else:
                        store.wait_host(store.to_host(staging, d, what))
                    if keep is not None:
                        with dev.cpu_work(f"keep {what}", moved_bytes=staging.nbytes):
                            pass
                    if ps.back:
                        copied = store.to_device(d, staging, what)
                        store.wait(copied)
                        store.wait_host(copied)

                stream_chunks(store, st, chunk_ranges(st.numel, chunk),
                              read=("grad",) if ps.add else (),
                              write=() if ps.back else ("grad",), step=step, pinned=True)

            passes = list(path.passes)
            while passes and passes[0].back:
                file_pass(passes.pop(0))
            st.grad_written = path.written
            keep = keeps_landed_grad(path, final=final, speculated=self.speculates(s))
            after = held_before(kept, config.held_gradients) if keep else None

            def file_passes():  # Engine._file_passes, on the landing worker
                held = None
                if keep:
                    if after is not None:
                        after.result()
                    slot = st.slot("grad")
                    held = store.alloc(Tier.HOST, TensorClass.STAGING, slot.numel(st.layout),
                                       slot.dtype)
                for ps in passes:
                    file_pass(ps, None if ps.back else held)
                return held

            self.in_flight = (lander.submit(file_passes), grad)
            self.speculate(s, final)
            if keep:
                kept[:] = [*kept, speculated[s][0]][-config.held_gradients:]

        def speculates(self, s: int) -> bool:  # Engine._speculates
            return config.speculative_disk_updates and states[s].tier == Tier.DISK

        def speculate(self, s: int, final: bool) -> None:  # Engine._speculate
            if final and self.speculates(s):
                to = states[s].spare()
                ahead = ahead_reads.pop(s, None)
                speculated[s] = (worker.submit(run_speculation, s, self.in_flight[0], to, ahead),
                                 to)

    cpu_cost = optimizer.cpu_cost

    def step_fn(st: _State, to: _State):  # Engine._update's `step` on one chunk of the segment
        def step(lo: int, bufs: dict) -> None:
            with dev.cpu_work(f"update {st.seg.name}", params=bufs["grad"].numel() * cpu_cost):
                pass
            if st.tier == Tier.DISK and st.compute_format is not None:  # the compute file
                staging = store.alloc(Tier.HOST, TensorClass.STAGING,
                                      st.compute_format.nbytes, torch.uint8)
                store.write_file(to.file("compute"), staging, TensorClass.COMPUTE).result()
                store.free(Tier.HOST, TensorClass.STAGING, staging)
        return step

    def update_remote(st: _State) -> None:  # the engine's remote update (T_PROTOCOL step 3)
        name = st.seg.name
        with dev.net(Link.NET_SEND, GRAD_B * st.numel, f"grad {name}"):
            ledger.record_move(Link.NET_SEND, GRAD_B * st.numel)
        with dev.node_work(f"update {name}", params=st.numel * cpu_cost):
            pass
        with dev.net(Link.NET_RECV, st.device_nbytes(), f"copy {name}"):  # its compute copy
            ledger.record_move(Link.NET_RECV, st.device_nbytes())

    def update(s: int, to: _State | None = None, ahead: Any = None, grad: Any = None
               ) -> None:  # Engine._update
        st = states[s]
        if st.placement.remote:
            update_remote(st)
        elif st.tier == Tier.DISK:
            if to is None:
                ahead = ahead_reads.pop(s, None)
            update_disk(st, step_fn(st, to or st), to or st, ahead, grad)
        else:
            step_fn(st, st)(0, {c: st.buffer(c) for c in (*st.state_copies, "grad")})

    def run_speculation(s: int, landed: Future, to: _State, ahead: Any) -> None:
        update(s, to, ahead, landed.result())  # Engine._run_speculation

    def resolve(s: int) -> None:  # Engine._resolve at coefficient 1: the commit
        fut, to = speculated.pop(s)
        fut.result()
        states[s].generation = to.generation
        stale = ahead_reads.pop(s, None)
        if stale is not None:
            for b in stale.buffers().values():
                store.free(Tier.HOST, TensorClass.STAGING, b)

    def update_ranges(st: _State) -> list[tuple[int, int]]:  # Engine._update_ranges
        if st.compute_format is not None:
            return [(0, st.numel)]
        return optimizer.chunk_ranges(st.layout, chunk)

    def update_disk(st: _State, step, to: _State, ahead: Any, grad: Any = None
                    ) -> None:  # Engine._update_disk
        writer.wait(st.index)
        held = {} if ahead is None else dict(ahead.buffers())
        if st.grad is not None:
            held["grad"] = st.grad
        elif grad is not None:  # kept by its landing
            held["grad"] = grad
        ranges = update_ranges(st)
        if writeback is not None and len(ranges) == 1:
            update_whole(st, step, held, to)
            return
        ends = {lo: lo + n for lo, n in ranges}

        def chunk_step(lo: int, bufs: dict) -> None:
            for c, buf in held.items():
                a, b = st.slot(c).range(st.layout, lo, ends[lo])
                bufs[c] = buf[a:b]
            step(lo, bufs)

        stream_chunks(store, st, ranges,
                      read=tuple(c for c in (*st.state_copies, "grad") if c not in held),
                      write=tuple(c for c in st.state_copies if c not in held), step=chunk_step,
                      written=to)
        if ahead is not None:
            write_back_copies(store, to, ahead.bufs)
        if grad is not None and st.grad is None:
            store.free(Tier.HOST, TensorClass.STAGING, grad)

    def update_whole(st: _State, step, held: dict, to: _State) -> None:  # Engine._update_whole
        writer.make_room()
        missing = tuple(c for c in (*st.state_copies, "grad") if c not in held)
        bufs = {**read_copies(store, st, missing), **held}
        step(0, bufs)
        if st.grad is None and "grad" in bufs:
            store.free(Tier.HOST, TensorClass.STAGING, bufs["grad"])
        later = deferred_copies(st.state_copies, st.compute_format is not None)
        write_back_copies(store, to, {c: bufs[c] for c in st.state_copies if c not in later})
        writer.submit(to, {c: bufs[c] for c in later})

    def finish_step() -> None:  # Engine._finish_step
        dev.read(_Bytes(1))  # the global norm: the step's one host read
        cache.drop_all()
        if frozen:
            return
        spec = [s for s in range(len(states)) if s in speculated]
        for s in spec:  # kept (the coefficient taken as 1), before the other updates
            updates[s] = worker.submit(resolve, s)
        for s, st in enumerate(states):
            if st.tier == Tier.DEVICE:
                with dev.compute(f"update {shape.names[s]}"):
                    pass
            else:
                if s not in spec:
                    updates[s] = worker.submit(update, s)
                if st.placement.resident:
                    st.device_stale = True
                    st.read_done = dev.mark()  # after the sweep's reads of its copy

    results, step_ops = [], []
    for _ in range(config.steps):
        begun = dev.begin_step()
        cache.begin(_stream_plan(shape, placements, actions))
        with LandingRing(store, ring_numel) as ring:  # type: ignore[arg-type]
            step = TimedStep(shape, placements, store, cache, actions, hidden, chunk,
                             lambda k, phase, a: None, ring)
            step.in_flight = None
            step.off = {}
            try:
                walk_step(step, actions, rules, ahead)
            finally:
                step.drain()
        finish_step()
        results.append(dev.end_step(begun))
        step_ops.append(dev.step_ops)
    timing = _timing(dev, results)
    timing.step_ops = step_ops
    return timing



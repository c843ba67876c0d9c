"""Pinned memory as counted (issue R, item 4): only what crosses PCIe is pinned, cut from one
arena per run (tierlm.memory.arena) sized by the rule the planner's replay counts
(tierlm.runtime.pinned), with no power-of-two rounding; the ledger counts pinned bytes as their
own class and preflight checks them against RAM. On this CPU-only machine the arena is plain
memory: the allocator and the accounting are the ones a GPU run uses."""

import copy

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, new_engine, tiny_model
from tierlm.memory.arena import (
    ArenaFullError,
    FreeList,
    PinnedArena,
    PinnedBytes,
    footprint_bytes,
)
from tierlm.memory.disk import ALIGN_BYTES
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.store import Store
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.plan.describe import describe
from tierlm.plan.evaluate import evaluate
from tierlm.plan.result import usable_budgets
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.train.preflight import check_pinned_memory
from tierlm.train.safety import HostMemoryError

CPU = torch.device("cpu")
B, T = 2, 16
CHUNK = 1024  # elements: every segment of the tiny model is several chunks
HW = PROFILES["cpu"]
KiB = 1024
STAGING, COMPUTE = TensorClass.STAGING, TensorClass.COMPUTE


def _arena(transient: int, persistent: int = 0) -> PinnedArena:
    return PinnedArena(PinnedBytes(persistent_bytes=persistent, transient_bytes=transient))


# -- the allocator ----


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_every_buffer_is_aligned_and_takes_whole_pages_not_a_power_of_two(dtype):
    sizes = [1, 1000, 4097, 3 * 4096 + 5]  # elements
    need = sum(footprint_bytes(n * dtype.itemsize) for n in sizes)
    arena = _arena(need)
    assert arena.capacity_bytes == need  # no rounding beyond 4 KiB units
    bufs = [arena.alloc(n, dtype, STAGING) for n in sizes]
    for n, b in zip(sizes, bufs, strict=True):
        assert b.dtype == dtype and b.numel() == n
        assert b.data_ptr() % ALIGN_BYTES == 0  # O_DIRECT works on it
        b.fill_(1)  # writable, and no two overlap:
    ends = sorted((b.data_ptr(), b.data_ptr() + b.numel() * dtype.itemsize) for b in bufs)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:], strict=False))
    assert arena.used_bytes == arena.peak_bytes == need
    with pytest.raises(ArenaFullError):  # full to the byte
        arena.alloc(1, torch.uint8, STAGING)


def test_a_freed_range_is_reused_and_neighbours_coalesce():
    arena = _arena(6 * 4 * KiB)
    a, b, c = (arena.alloc(4 * KiB, torch.uint8, STAGING) for _ in range(3))
    arena.free(b)
    again = arena.alloc(4 * KiB, torch.uint8, STAGING)
    assert again.data_ptr() == b.data_ptr()  # the hole, not the untouched tail
    arena.free(a)
    arena.free(again)  # a and b's ranges are one now: an 8 KiB request fits there
    joined = arena.alloc(8 * KiB, torch.uint8, STAGING)
    assert joined.data_ptr() == a.data_ptr()
    for t in (joined, c):
        arena.free(t)
    assert arena.used_bytes == 0
    whole = arena.alloc(6 * 4 * KiB, torch.uint8, STAGING)  # everything coalesced back
    assert whole.data_ptr() == a.data_ptr()


def test_best_fit_among_the_holes_and_the_top_last():
    free = FreeList(60)
    offsets = [free.take(n) for n in (10, 5, 10, 5, 10)]  # 0, 10, 15, 25, 30; 40.. free
    free.give(offsets[1], 5)
    free.give(offsets[2], 10)  # joins the 5 before it: a hole [10, 25)
    free.give(offsets[4], 10)  # joins the top: [30, 60)
    free.give(offsets[0], 10)  # joins the hole: [0, 25)
    assert free.ranges == [(0, 25), (30, 30)]
    assert free.take(8) == 0  # a hole that holds it, though the top is larger...
    assert free.take(20) == 30  # ...and the top only when no hole does
    free.give(0, 8)
    assert free.take(26) is None  # 25 + 10 free, neither range holds 26
    with pytest.raises(AssertionError, match="freed twice"):
        free.give(5, 10)


def test_a_replayed_sequence_sizes_a_list_that_never_runs_out():
    """A growing list (the planner's replay) ends at the capacity the sequence needs; a list of
    that capacity takes the very same offsets, fragmentation included."""
    g = torch.Generator().manual_seed(0)
    ops, live = [], []
    for _ in range(300):
        if live and torch.rand((), generator=g) < 0.45:
            ops.append(("give", live.pop(int(torch.randint(len(live), (), generator=g)))))
        else:
            n = int(torch.randint(1, 9, (), generator=g)) * 4096
            ops.append(("take", len(ops), n))
            live.append(len(ops) - 1)

    def run(free: FreeList) -> dict[int, tuple[int, int]]:
        got = {}
        for op in ops:
            if op[0] == "take":
                got[op[1]] = (free.take(op[2]), op[2])
            else:
                free.give(*got[op[1]])
        return got

    grown = FreeList(0, grow=True)
    replayed = run(grown)
    fixed = run(FreeList(grown.capacity_bytes))
    assert fixed == replayed and None not in {o for o, _ in fixed.values()}
    most_live = max(sum(n for o, (_, n) in replayed.items() if o <= k and all(
        op[1] != o for op in ops[: k + 1] if op[0] == "give")) for k in range(len(ops)))
    assert most_live <= grown.capacity_bytes  # at least the live peak; the rest: holes


def test_running_out_names_the_class_the_bytes_and_the_arena():
    arena = _arena(8 * KiB, persistent=4 * KiB)
    arena.alloc(1000, torch.float32, COMPUTE)  # the persistent region: 4000 -> 4 KiB
    with pytest.raises(ArenaFullError) as err:
        arena.alloc(3000, torch.float32, STAGING)  # 12,000 bytes in an 8 KiB step region
    msg = str(err.value)
    assert "staging asked for 12,000 bytes" in msg
    assert "step region of 8,192 bytes (12,288 in all)" in msg
    assert "step_pinned_bytes" in msg  # whose count was short


def test_a_range_a_copy_may_still_use_comes_back_once_its_event_passes():
    class Done:
        def __init__(self) -> None:
            self.passed = self.waited = False

        def query(self) -> bool:
            return self.passed

        def synchronize(self) -> None:
            self.waited = self.passed = True

    arena = _arena(8 * KiB)
    a = arena.alloc(4 * KiB, torch.uint8, STAGING)
    b = arena.alloc(4 * KiB, torch.uint8, STAGING)
    done = Done()
    arena.free(a, done)
    assert arena.used_bytes == 8 * KiB  # still the copy's
    arena.free(b)
    c = arena.alloc(4 * KiB, torch.uint8, STAGING)
    assert c.data_ptr() == b.data_ptr() and not done.waited  # the free range first
    d = arena.alloc(4 * KiB, torch.uint8, STAGING)  # only a's range is left: waits for it
    assert done.waited and d.data_ptr() == a.data_ptr()


def test_the_step_region_grows_between_steps_only():
    arena = _arena(4 * KiB, persistent=4 * KiB)
    kept = arena.alloc(1024, torch.float32, TensorClass.MASTER)
    assert not arena.reserve_transient(4 * KiB)
    t = arena.alloc(1024, torch.float32, STAGING)
    with pytest.raises(ArenaFullError, match="still holds 1 buffers"):
        arena.reserve_transient(8 * KiB)
    arena.free(t)
    assert arena.reserve_transient(8 * KiB + 1)
    assert arena.transient_bytes == 12 * KiB and arena.persistent_bytes == 4 * KiB
    assert arena.owns(kept)  # the persistent region did not move
    arena.alloc(3 * 1024, torch.float32, STAGING)


def test_a_persistent_copy_past_the_plan_gets_a_block_of_its_own():
    """An fp8 layer switched to bf16 widens its segment's compute copy after the arena was
    sized: the copy is pinned in a block of exactly its size, not refused."""
    arena = _arena(0, persistent=8 * KiB)
    wire = arena.alloc(8 * KiB, torch.uint8, COMPUTE)
    arena.free(wire)
    wider = arena.alloc(12 * KiB, torch.uint8, COMPUTE)
    assert arena.owns(wider) and arena.persistent_bytes == 20 * KiB
    assert wider.data_ptr() % ALIGN_BYTES == 0
    narrow = arena.alloc(8 * KiB, torch.uint8, COMPUTE)  # the first block's range again
    assert arena.persistent_bytes == 20 * KiB and arena.used_bytes == 20 * KiB
    arena.free(narrow)
    arena.free(wider)


def test_the_store_pins_only_what_it_is_asked_to():
    store = Store(CPU)
    store.open_arena(PinnedBytes(persistent_bytes=0, transient_bytes=8 * KiB))
    led = store.ledger
    plain = store.alloc(Tier.HOST, TensorClass.OPTIM, 10)
    pinned = store.alloc(Tier.HOST, STAGING, 10, pinned=True)
    assert not store.arena.owns(plain) and store.arena.owns(pinned)
    assert plain.data_ptr() % ALIGN_BYTES == 0  # pageable, still O_DIRECT-aligned
    assert led.tier_bytes(Tier.HOST) == 80  # both, by their bytes
    assert led.pinned_bytes == 4 * KiB and dict(led.pinned_class_bytes) == {STAGING: 4 * KiB}
    store.free(Tier.HOST, STAGING, pinned)
    store.free(Tier.HOST, TensorClass.OPTIM, plain)
    assert led.pinned_bytes == 0 and led.pinned_peak_bytes == 4 * KiB
    assert led.snapshot()["host_pinned_peak_bytes"] == 4 * KiB
    with pytest.raises(ValueError, match="only host buffers are pinned"):
        store.alloc(Tier.DEVICE, TensorClass.COMPUTE, 10, pinned=True)
    with pytest.raises(ValueError, match="opened once"):
        store.open_arena(PinnedBytes(persistent_bytes=0, transient_bytes=0))


# -- the engine against the plan ----

PLACEMENTS = {
    "host": SegmentPlacement(False, Tier.HOST),
    "disk": SegmentPlacement(False, Tier.DISK),
    "disk-host-grads": SegmentPlacement(False, Tier.DISK, Tier.HOST),
}


def _engine(model, tmp_path, spec, order, m, boundary, chunk=CHUNK):
    n = len(ModelShape.from_config(copy.deepcopy(model.config)).names)
    return new_engine(model, tmp_path, policy="auto", placements=[PLACEMENTS[spec]] * n,
                      microbatch_order=order, micro_batches=m, staging_chunk_numel=chunk,
                      boundary_tier=boundary, keep_resident_activations=False)


def _count_live_pinned(store: Store) -> list[int]:
    """Spy on `store`: [pinned buffers held now, the most held at once]."""
    live = [0, 0]
    alloc, free = store.alloc, store.free

    def spy_alloc(*args, pinned=False, **kw):
        t = alloc(*args, pinned=pinned, **kw)
        if pinned:
            live[0] += 1
            live[1] = max(live)
        return t

    def spy_free(tier, cls, t):
        live[0] -= store.arena.owns(t)
        free(tier, cls, t)

    store.alloc, store.free = spy_alloc, spy_free
    return live


@pytest.mark.parametrize("boundary", [Tier.DEVICE, Tier.HOST])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("spec, layers, chunk", [
    ("host", 2, CHUNK), ("disk", 2, CHUNK), ("disk-host-grads", 2, CHUNK),
    # segments smaller than a chunk, of three sizes: loads, landings and parked inputs of
    # several sizes interleave in the arena
    ("disk", 3, 1 << 20), ("disk-host-grads", 3, 1 << 20)])
def test_the_arena_is_the_ledgers_pinned_peak_and_the_plans(spec, layers, chunk, order,
                                                            boundary, tmp_path):
    """After a step of a streamed tiny model, the arena the engine sized before it holds the
    pinned peak its ledger counted, within one 4 KiB unit per buffer held at that peak (what
    the order of allocations leaves unusable between them; the ledger counts each buffer in
    whole units already); the arena held that peak at once; and the planner's replay of the
    same configuration predicts both the peak and the arena."""
    model = tiny_model("llama_untied", layers=layers)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    m = 2
    eng = _engine(model, tmp_path, spec, order, m, boundary, chunk)
    arena, led = eng.store.arena, eng.ledger
    live = _count_live_pinned(eng.store)
    live[0] = len(eng.states) if spec == "host" else 0  # the masters, pinned at init
    eng.step(batches(1, m)[0], OPTIM.lr)
    eng.synchronize()
    peak = led.pinned_peak_bytes
    assert peak > 0 and arena.peak_bytes == peak
    assert 0 <= arena.capacity_bytes - peak <= ALIGN_BYTES * live[1]
    assert arena.capacity_bytes == eng.report.pinned.total_bytes  # what preflight was shown
    classes = {c for c, v in led.pinned_class_peak_bytes.items() if v}
    want = {STAGING} | ({TensorClass.MASTER} if spec == "host" else set()) | (
        {TensorClass.ACTIVATION} if boundary == Tier.HOST else set())
    assert classes == want  # optimizer state and gradients are never pinned
    predicted = evaluate(shape, TrainShape(B, T, m, "fp32"), HW, [PLACEMENTS[spec]] * len(
        shape.names), order, False, usable_budgets(HW), boundary_host=boundary == Tier.HOST,
        chunk_numel=chunk)
    assert predicted.pinned_peak_bytes == peak
    assert predicted.pinned_arena_bytes == arena.capacity_bytes
    assert predicted.pinned_by_class == {c.value: v for c, v in
                                         led.pinned_class_peak_bytes.items() if v}
    eng.step(batches(2, m)[1], OPTIM.lr)  # a second step fits the same arena
    eng.synchronize()
    assert arena.capacity_bytes == eng.store.arena.capacity_bytes
    assert led.step_pinned_peak_bytes == peak
    eng.close()


def test_host_state_pins_the_master_it_streams_not_its_optimizer_state(tmp_path):
    eng = _engine(tiny_model("llama_untied", layers=2), tmp_path, "host", "microbatch-outer", 1,
                  Tier.DEVICE)
    arena = eng.store.arena
    for st in eng.states:
        assert arena.owns(st.master)  # the H2D copies read it
        assert not arena.owns(st.grad)
        assert not any(arena.owns(t) for t in st.state.values())
    assert arena.persistent_bytes == sum(footprint_bytes(4 * st.numel) for st in eng.states)
    eng.close()


def test_a_step_larger_than_planned_grows_the_step_region_and_stays_exact(tmp_path):
    """Parked inputs scale with the micro-batches: a step of more than the planned ones grows
    the arena's step region before it starts, to what the rule says it needs."""
    model = tiny_model("llama_untied", layers=2)
    eng = _engine(model, tmp_path, "disk", "layer-outer", 1, Tier.HOST)
    planned = eng.store.arena.transient_bytes
    eng.step(batches(1, 3)[0], OPTIM.lr)
    eng.synchronize()
    arena = eng.store.arena
    assert arena.transient_bytes > planned
    assert arena.transient_bytes == eng.pinned_bytes(3, B, T).transient_bytes
    assert eng.ledger.step_pinned_peak_bytes == arena.capacity_bytes
    eng.close()


def test_plan_prints_its_pinned_bytes():
    model = tiny_model("llama_untied", layers=2)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    train = TrainShape(B, T, 2, "fp32")
    p = evaluate(shape, train, HW, [PLACEMENTS["host"]] * len(shape.names), "microbatch-outer",
                 False, usable_budgets(HW), chunk_numel=CHUNK)
    text = describe(p, shape, train, HW)
    line = next(ln for ln in text.splitlines() if "pinned for PCIe copies" in ln)
    assert "master" in line and "in one arena of" in line
    assert p.to_json()["pinned_peak_bytes"] == p.pinned_peak_bytes > 0


# -- preflight ----


def test_preflight_refuses_pinned_bytes_past_the_ram_and_warns_past_half():
    logs: list[str] = []
    GiB = 1 << 30
    check_pinned_memory(10 * GiB, 20 * GiB, 40 * GiB, 64 * GiB, logs.append)
    assert logs == []
    check_pinned_memory(40 * GiB, 0, 48 * GiB, 64 * GiB, logs.append)
    assert len(logs) == 1 and "more than 50%" in logs[0]
    with pytest.raises(HostMemoryError, match="--host-budget") as err:
        check_pinned_memory(30 * GiB, 20 * GiB, 40 * GiB, 64 * GiB, logs.append)
    assert "pins 30.00 GiB" in str(err.value) and "cannot be swapped" in str(err.value)

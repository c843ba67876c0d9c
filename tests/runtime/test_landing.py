"""A device gradient is added into host RAM through a ring of host staging chunks
(tierlm.runtime.landing): the sum is bitwise the plain `host += dev`, the next chunk's copy is
in flight while the CPU adds this one, the ring is the step's (taken once, at its first landing
into host RAM, released when the sweep ends), and the staging is the rule the planner's replay
counts (tierlm.runtime.schedule), landing by landing."""

import copy
import threading

import pytest
import torch

from tests.runtime_helpers import (
    OPTIM,
    InfGrad,
    assert_close_run,
    batches,
    new_engine,
    reference_run,
    tiny_model,
)
from tierlm.memory import Tier
from tierlm.memory.device import HostDevice
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass
from tierlm.plan.evaluate import evaluate
from tierlm.plan.result import usable_budgets
from tierlm.runtime import Engine
from tierlm.runtime import byte_replay as planner
from tierlm.runtime.byte_replay import _simulate
from tierlm.runtime.landing import LandingRing, add_to_host
from tierlm.runtime.schedule import landing_ring_numel, landing_staging_numel, step_schedule
from tierlm.runtime.shapes import ModelShape, TrainShape

CPU = torch.device("cpu")
B, T = 2, 16
CHUNK = 1024  # elements: every segment of the tiny models is more than two chunks
HW = PROFILES["cpu"]
PLACEMENTS = {
    "host": SegmentPlacement(False, Tier.HOST),
    "disk-host-grads": SegmentPlacement(False, Tier.DISK, Tier.HOST),
    "disk": SegmentPlacement(False, Tier.DISK),
}


@pytest.mark.parametrize("numel", [5 * CHUNK + 17, 2 * CHUNK, CHUNK - 3])
def test_the_ring_adds_bitwise_what_one_add_gives(numel):
    g = torch.Generator().manual_seed(numel)
    dev = torch.randn(numel, generator=g)
    host = torch.randn(numel, generator=g)
    want = host.clone().add_(dev)
    store = Store(CPU)
    led = store.ledger
    with LandingRing(store, landing_staging_numel(numel, CHUNK)) as ring:
        assert led.tier_bytes(Tier.HOST) == 0  # taken at the first landing, not before
        add_to_host(store, ring, host, dev, CHUNK, "grad")
        assert torch.equal(host, want)
        assert led.tier_bytes(Tier.HOST) == 4 * min(numel, 2 * CHUNK)  # held for the next
        # a second landing of a smaller gradient reuses the ring: nothing more is allocated
        small = torch.randn(numel // 2, generator=g)
        want_small = host[: numel // 2].clone().add_(small)
        add_to_host(store, ring, host[: numel // 2], small, CHUNK, "grad")
        assert torch.equal(host[: numel // 2], want_small)
    assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == (
        4 * landing_staging_numel(numel, CHUNK))
    assert led.tier_bytes(Tier.HOST) == 0  # the ring is released
    # the two gradients' bytes
    assert dict(led.total_moved_bytes) == {Link.D2H: 4 * (numel + numel // 2)}


def test_a_ring_smaller_than_the_landing_is_refused():
    store = Store(CPU)
    dev, host = torch.ones(3 * CHUNK), torch.zeros(3 * CHUNK)
    with LandingRing(store, CHUNK) as ring, pytest.raises(ValueError, match="landing_ring"):
        add_to_host(store, ring, host, dev, CHUNK, "grad x")
    assert torch.equal(host, torch.zeros(3 * CHUNK))
    assert store.ledger.tier_bytes(Tier.HOST) == 0


class _Event:
    def __init__(self, k: int) -> None:
        self.k = k


class _AsyncStore:
    """A store whose D2H copies land only when waited for (as a GPU's do, at the latest), and
    which logs the order of copies and waits, with the chunks of `host` added by then. Fresh
    staging is NaN, so reading a chunk before its copy landed shows in the sum."""

    def __init__(self, host: torch.Tensor, chunk: int) -> None:
        self.host, self.before, self.chunk = host, host.clone(), chunk
        self.log: list[tuple[str, int, frozenset[int]]] = []
        self.inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dev = HostDevice(torch.device("cpu"))  # prices nothing: the adds run as they come
        self.allocated = self.freed = 0

    def added(self) -> frozenset[int]:
        n = -(-self.host.numel() // self.chunk)
        return frozenset(k for k in range(n) if not torch.equal(
            self.host[k * self.chunk:(k + 1) * self.chunk],
            self.before[k * self.chunk:(k + 1) * self.chunk]))

    def alloc(self, tier, cls, numel, dtype=torch.float32, *, pinned=False):
        assert (tier, cls, pinned) == (Tier.HOST, TensorClass.STAGING, True)
        self.allocated += numel
        return torch.full((numel,), float("nan"), dtype=dtype)

    def free(self, tier, cls, t):
        self.freed += t.numel()

    def to_host(self, dst, src, what="", after=None):
        k = len([e for e in self.log if e[0] == "copy"])
        self.log.append(("copy", k, self.added()))
        self.inflight[k] = (dst, src.clone())
        return _Event(k)

    def wait_host(self, event):
        self.log.append(("wait", event.k, self.added()))
        dst, src = self.inflight.pop(event.k)
        dst.copy_(src)


def test_the_next_chunk_is_copied_while_this_one_is_added():
    n_chunks, numel = 4, 4 * CHUNK - 5
    dev = torch.arange(numel, dtype=torch.float32)
    host = torch.ones(numel)
    store = _AsyncStore(host, CHUNK)
    with LandingRing(store, 2 * CHUNK) as ring:  # type: ignore[arg-type]
        add_to_host(store, ring, host, dev, CHUNK)  # type: ignore[arg-type]
    assert torch.equal(host, torch.ones(numel) + dev)
    assert store.allocated == store.freed == landing_staging_numel(numel, CHUNK) == 2 * CHUNK
    copies = {k: added for op, k, added in store.log if op == "copy"}
    waits = {k: added for op, k, added in store.log if op == "wait"}
    assert sorted(copies) == sorted(waits) == list(range(n_chunks))
    for k in range(1, n_chunks):
        # chunk k's copy is issued before chunk k-1 is added, and after chunk k-2 is (its
        # buffer is the one chunk k lands in)
        assert k - 1 not in copies[k] and set(range(k - 1)) <= copies[k]
    for k in range(n_chunks):
        assert waits[k] == frozenset(range(k))  # chunk k is added after its copy landed
    order = [(op, k) for op, k, _ in store.log]
    assert order == [("copy", 0)] + [e for k in range(1, n_chunks)
                                     for e in (("copy", k), ("wait", k - 1))] + [
        ("wait", n_chunks - 1)]


@pytest.mark.parametrize(("m", "order", "want"), [
    (2, "microbatch-outer", CHUNK),  # the disk segment's second landing adds into its file
    (2, "layer-outer", CHUNK // 2),  # it lands once, written out: only the host one adds
    (1, "microbatch-outer", CHUNK // 2),
])
def test_the_step_ring_is_its_largest_landing(m, order, want):
    """Sized for the largest landing of the step, in the order the step lands: a host gradient's
    ring over its gradient, a disk gradient's over one chunk where a file pass adds."""
    landings = [None, (Tier.HOST, Tier.HOST, CHUNK // 2), (Tier.DISK, Tier.DISK, 5 * CHUNK),
                (Tier.DEVICE, Tier.DEVICE, 9 * CHUNK)]
    actions = step_schedule(len(landings), m, order)
    assert landing_ring_numel(actions, m, landings, CHUNK) == want
    assert landing_ring_numel(actions, m, [None] * len(landings), CHUNK) == 0


def _engine(model, tmp_path, spec: str, order: str, m: int, chunk: int | None = CHUNK) -> Engine:
    n_segs = len(ModelShape.from_config(copy.deepcopy(model.config)).names)
    extra = {} if chunk is None else {"staging_chunk_numel": chunk}
    return new_engine(model, tmp_path, policy="auto", placements=[PLACEMENTS[spec]] * n_segs,
                      microbatch_order=order, micro_batches=m, grad_clip=0.05, **extra)


@pytest.mark.parametrize("spec", ["host", "disk-host-grads"])
def test_chunked_landings_train_as_the_reference(spec, tmp_path):
    """Gradients of several chunks each land through the ring: the run is bitwise the run whose
    gradients land in one piece, and matches the reference trainer."""
    base = tiny_model("llama_tied_gqa", layers=2)
    m, steps = 2, batches(2, 2)
    lrs = [OPTIM.lr, OPTIM.lr * 0.9]
    runs = []
    for chunk in (CHUNK, None):
        eng = _engine(copy.deepcopy(base), tmp_path / str(chunk), spec, "microbatch-outer", m,
                      chunk)
        assert chunk is None or all(st.numel > 2 * CHUNK for st in eng.states[:-1])
        recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
        runs.append((recs, eng.weights()))
        eng.close()
    (chunked, weights), (whole, whole_weights) = runs
    assert [r["loss"] for r in chunked] == [r["loss"] for r in whole]
    for k, v in whole_weights.items():
        assert torch.equal(weights[k], v), k
    ref_recs, ref_weights = reference_run(copy.deepcopy(base), steps, lrs, 0.05)
    assert_close_run([r["loss"] for r in chunked], [r["loss"] for r in ref_recs], weights,
                     ref_weights)


class _LandingStaging:
    """Host staging taken on the step's thread while a landing runs, followed until it is freed
    (the step's landing ring outlives the landing that took it): for each landing, the most
    such bytes held at once while it ran and those still held from earlier landings when it
    began; and the elements of each buffer that outlived the landing which took it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.held: dict[int, tuple[object, int]] = {}  # id -> (the buffer, kept alive; bytes)
        self.peaks: list[int] = []
        self.carried: list[int] = []
        self.landing = False
        self.outlived: list[int] = []

    def now(self) -> int:
        return sum(n for _, n in self.held.values())

    def alloc(self, t, tier, cls) -> None:
        if self.landing and threading.get_ident() == self.thread and (
                tier, cls) == (Tier.HOST, TensorClass.STAGING):
            self.held[id(t)] = (t, t.numel() * t.element_size())
            self.peaks[-1] = max(self.peaks[-1], self.now())

    def free(self, t) -> None:
        self.held.pop(id(t), None)

    def land(self, land, *args, **kwargs) -> None:
        self.carried.append(self.now())
        self.peaks.append(self.now())
        before = set(self.held)
        self.landing = True
        try:
            land(*args, **kwargs)
        finally:
            self.landing = False
            self.outlived += [self.held[k][0].numel() for k in self.held if k not in before]


def _watch_engine(eng: Engine) -> _LandingStaging:
    watch = _LandingStaging()
    store, land = eng.store, eng._land_grad
    alloc, free = store.alloc, store.free

    def spy_alloc(tier, cls, numel, dtype=torch.float32, **kw):
        t = alloc(tier, cls, numel, dtype, **kw)
        watch.alloc(t, tier, cls)
        return t

    def spy_free(tier, cls, t):
        watch.free(t)
        free(tier, cls, t)

    store.alloc, store.free = spy_alloc, spy_free
    eng._land_grad = lambda *args, **kwargs: watch.land(land, *args, **kwargs)
    return watch


def _watch_replay(monkeypatch) -> _LandingStaging:
    watch = _LandingStaging()

    class Store(planner._CountingStore):
        def alloc(self, tier, cls, numel, dtype=None, **kw):
            t = super().alloc(tier, cls, numel, dtype, **kw)
            watch.alloc(t, tier, cls)
            return t

        def free(self, tier, cls, t):
            watch.free(t)
            super().free(tier, cls, t)

    class Step(planner._CountingStep):
        def land(self, *args, **kwargs):
            watch.land(super().land, *args, **kwargs)

    monkeypatch.setattr(planner, "_CountingStore", Store)
    monkeypatch.setattr(planner, "_CountingStep", Step)
    return watch


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("spec", ["host", "disk-host-grads", "disk"])
def test_each_landing_stages_what_the_plan_counts(spec, order, tmp_path, monkeypatch):
    """Landing by landing, the host staging the engine holds (the step's ring included, once
    taken) is what the replay counts, and both release all of it when the step ends."""
    model = tiny_model("llama_untied", layers=2)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    placements = [PLACEMENTS[spec]] * len(shape.names)
    m = 2
    train = TrainShape(B, T, m, "fp32")
    replay = _watch_replay(monkeypatch)
    _simulate(shape, train, placements, order, True, chunk_numel=CHUNK)
    monkeypatch.undo()
    planned = replay.peaks
    assert len(planned) == len(shape.names) * (m if order == "microbatch-outer" else 1)
    assert replay.held == {}  # the ring is released at the end of the sweep
    # one ring, taken by the first landing that adds into host RAM and held past the rest
    ring_numel = 0 if (spec, order) == ("disk", "layer-outer") else (
        CHUNK if spec == "disk" else 2 * CHUNK)
    assert replay.outlived == ([ring_numel] if ring_numel else [])
    # the landing that takes it: the first, or a file's first that adds (the second
    # micro-batch's); it is carried into each landing after that one
    taken = {"host": 0, "disk-host-grads": 0, "disk": len(shape.names)}[spec]
    assert replay.carried == [0] * min(taken + 1, len(planned)) + [4 * ring_numel] * (
        len(planned) - taken - 1)

    eng = _engine(model, tmp_path, spec, order, m)
    watch = _watch_engine(eng)
    for step in batches(2, m):
        eng.step(step, OPTIM.lr)
        assert watch.held == {}
    eng.synchronize()
    led = eng.ledger
    eng.close()
    assert watch.peaks == planned + planned  # two steps, landing by landing
    assert watch.carried == replay.carried + replay.carried
    assert watch.outlived == replay.outlived + replay.outlived
    # a device gradient lands through two chunks, never the whole segment's gradient
    ring = 4 * 2 * CHUNK
    assert min(planned) >= ring and 4 * min(shape.numels) > ring
    if spec == "disk" and order == "microbatch-outer":  # the later landings add file + device
        assert max(planned) == 4 * 3 * CHUNK  # two chunks staged beside the one-chunk ring
    if spec == "host":  # the only host staging: the ledger's peak is the plan's, exactly
        predicted = evaluate(shape, train, HW, placements, order, True, usable_budgets(HW),
                             chunk_numel=CHUNK)
        assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == ring
        assert predicted.host_by_class["staging"] == ring
        assert led.peak_tier_bytes[Tier.HOST] == predicted.host_peak_bytes


@pytest.mark.parametrize("spec", ["host", "disk"])
def test_the_ring_is_taken_once_per_step_and_released_at_its_end(spec, tmp_path):
    """One allocation of the ring per step, however many landings add through it; the ledger's
    host staging is back where it was after a step, a skipped (non-finite) one and one that
    raised mid-sweep."""
    model = tiny_model("llama_untied", layers=2)
    m = 2
    eng = _engine(model, tmp_path, spec, "microbatch-outer", m)
    ring_numel = eng.landing_ring_numel(eng.schedule(m), m)
    assert ring_numel == (2 * CHUNK if spec == "host" else CHUNK)
    staging = (Tier.HOST, TensorClass.STAGING)
    watch = _watch_engine(eng)  # the ring: the one staging buffer that outlives its landing
    hook = InfGrad()
    model.model.layers[1].mlp.register_forward_hook(hook)
    steps = batches(3, m)
    for i, step in enumerate(steps):
        eng.synchronize()  # the last update's staging (a disk update's) is released
        before = eng.ledger.current_bytes[staging]
        hook.armed = i == 1
        rec = eng.step(step, OPTIM.lr)
        assert rec["skipped"] == (i == 1)
        assert watch.outlived == [ring_numel] * (i + 1)  # the step's one ring
        assert watch.held == {}
        if spec == "host":  # nothing else stages on the step's thread
            assert eng.ledger.current_bytes[staging] == before
    assert eng.skipped_steps == 1
    # a landing that fails after the ring was taken (the first final landing, once it has
    # added into host RAM): the step raises, the ring is released
    eng.synchronize()
    before = eng.ledger.current_bytes[staging]
    complete = eng._grad_complete

    def failing(*args, **kwargs):
        raise RuntimeError("sync failed")

    eng._grad_complete = failing
    with pytest.raises(RuntimeError, match="sync failed"):
        eng.step(steps[0], OPTIM.lr)
    eng._grad_complete = complete
    assert watch.outlived == [ring_numel] * (len(steps) + 1)
    assert watch.held == {}
    if spec == "host":
        assert eng.ledger.current_bytes[staging] == before
    eng.close()

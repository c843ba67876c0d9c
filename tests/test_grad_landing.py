"""A device gradient is added into host RAM through a ring of host staging chunks
(tierlm.runtime.landing): the sum is bitwise the plain `host += dev`, the next chunk's copy is
in flight while the CPU adds this one, and the staging is the rule the planner's replay counts
(tierlm.runtime.schedule), landing by landing."""

import copy
import threading

import pytest
import torch
from runtime_helpers import OPTIM, assert_close_run, batches, reference_run, tiny_model

from tierlm.memory import Tier
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.planner import ModelShape, TrainShape, _simulate, evaluate, usable_budgets
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass
from tierlm.runtime import Engine, EngineOptions, build_engine
from tierlm.runtime.landing import add_to_host
from tierlm.runtime.schedule import GradLanding, landing_staging_numel

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
    add_to_host(store, host, dev, CHUNK, "grad")
    assert torch.equal(host, want)
    led = store.ledger
    assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == 4 * min(numel, 2 * CHUNK)
    assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == (
        4 * landing_staging_numel(numel, CHUNK))
    assert led.tier_bytes(Tier.HOST) == 0  # the ring is released
    assert dict(led.total_moved_bytes) == {Link.D2H: 4 * numel}  # one gradient's bytes


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
        self.allocated = self.freed = 0

    def added(self) -> frozenset[int]:
        n = -(-self.host.numel() // self.chunk)
        return frozenset(k for k in range(n) if not torch.equal(
            self.host[k * self.chunk:(k + 1) * self.chunk],
            self.before[k * self.chunk:(k + 1) * self.chunk]))

    def alloc(self, tier, cls, numel, dtype=torch.float32):
        assert (tier, cls) == (Tier.HOST, TensorClass.STAGING)
        self.allocated += numel
        return torch.full((numel,), float("nan"), dtype=dtype)

    def free(self, tier, cls, t):
        self.freed += t.numel()

    def to_host(self, dst, src, what=""):
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
    add_to_host(store, host, dev, CHUNK)  # type: ignore[arg-type]
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


def _engine(model, tmp_path, spec: str, order: str, m: int, chunk: int | None = CHUNK) -> Engine:
    n_segs = len(ModelShape.from_config(copy.deepcopy(model.config)).names)
    extra = {} if chunk is None else {"staging_chunk_numel": chunk}
    return build_engine(model, OPTIM, EngineOptions(
        policy="auto", placements=[PLACEMENTS[spec]] * n_segs, microbatch_order=order,
        micro_batches=m, offload_dir=str(tmp_path), batch_size=B, seq_len=T, grad_clip=0.05,
        **extra),
        device=CPU)


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


def _engine_landings(eng: Engine) -> list[int]:
    """Run the engine's landings through a spy: for each, the most host staging bytes it held
    at once (allocated on the step's thread while it ran)."""
    main = threading.get_ident()
    store, land = eng.store, eng._land_grad
    alloc, free = store.alloc, store.free
    out: list[int] = []
    now = [None, 0]  # [peak of the landing running, its bytes held]

    def spy_alloc(tier, cls, numel, dtype=torch.float32):
        t = alloc(tier, cls, numel, dtype)
        if now[0] is not None and threading.get_ident() == main and (
                tier, cls) == (Tier.HOST, TensorClass.STAGING):
            now[1] += t.numel() * t.element_size()
            now[0] = max(now[0], now[1])
        return t

    def spy_free(tier, cls, t):
        if now[0] is not None and threading.get_ident() == main and (
                tier, cls) == (Tier.HOST, TensorClass.STAGING):
            now[1] -= t.numel() * t.element_size()
        free(tier, cls, t)

    def spy_land(st, grad, *, final):
        now[:] = [0, 0]
        land(st, grad, final=final)
        assert now[1] == 0  # all of it released
        out.append(now[0])
        now[0] = None

    store.alloc, store.free, eng._land_grad = spy_alloc, spy_free, spy_land
    return out


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("spec", ["host", "disk-host-grads", "disk"])
def test_each_landing_stages_what_the_plan_counts(spec, order, tmp_path, monkeypatch):
    model = tiny_model("llama_untied", layers=2)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    placements = [PLACEMENTS[spec]] * len(shape.names)
    m = 2
    train = TrainShape(B, T, m, "fp32")
    # the replay's landings, in its order: the staging its rule counts for each
    planned: list[int] = []
    rule = GradLanding.host_staging_numel

    def counted(self, numel, chunk_numel):
        n = rule(self, numel, chunk_numel)
        planned.append(4 * n)
        return n

    monkeypatch.setattr(GradLanding, "host_staging_numel", counted)
    _simulate(shape, train, placements, order, True, chunk_numel=CHUNK)
    monkeypatch.undo()
    assert len(planned) == len(shape.names) * (m if order == "microbatch-outer" else 1)

    eng = _engine(model, tmp_path, spec, order, m)
    landed = _engine_landings(eng)
    for step in batches(2, m):
        eng.step(step, OPTIM.lr)
    eng.synchronize()
    led = eng.ledger
    eng.close()
    assert landed == planned + planned  # two steps, landing by landing
    # a device gradient lands through two chunks, never the whole segment's gradient
    ring = 4 * 2 * CHUNK
    assert min(planned) >= ring and 4 * min(shape.numels) > ring
    if spec == "host":  # the only host staging: the ledger's peak is the plan's, exactly
        predicted = evaluate(shape, train, HW, placements, order, True, usable_budgets(HW),
                             chunk_numel=CHUNK)
        assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] == ring
        assert predicted.host_by_class["staging"] == ring
        assert led.peak_tier_bytes[Tier.HOST] == predicted.host_peak_bytes

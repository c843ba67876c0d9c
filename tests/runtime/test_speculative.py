"""Speculative disk-tier updates (EngineOptions.speculative_updates): each disk-tier segment's
update runs at its gradient's final landing with the clipping coefficient taken as 1, into the
spare generation of its files, and is kept (coefficient exactly 1), redone (below 1) or dropped
(a skipped step) once the global norm is read. Whatever happens, the run is bit for bit the run
without the option: losses, gradient norms, weights and optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.runtime_helpers import InfGrad, batches, bf16_autocast, bf16_model, tiny_model
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.readahead import ReadAhead

STEPS, M, LR = 3, 2, 1e-2
DISK = [SegmentPlacement(False, Tier.DISK)] * 4
# embed on the device, a resident disk block holding its gradient on the host, a streamed disk
# block with a gradient file, the head streamed from host state; bf16: the disk blocks' compute
# files
TIERED = [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(True, Tier.DISK, Tier.HOST),
          SegmentPlacement(False, Tier.DISK), SegmentPlacement(False, Tier.HOST)]
# clip: 1e9 keeps the coefficient at 1 (every speculation is kept), 1e-3 below (each redone);
# "skip": an infinite gradient on the second step, the others kept
REGIMES = {"commit": (1e9, None), "redo": (1e-3, None), "skip": (1e9, 1)}


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama_untied", layers=2)


def _run(base, placements, order, regime, tmp_path, *, speculative, bf16, **options):
    clip, skip = REGIMES[regime]
    model = copy.deepcopy(base)
    hook = InfGrad()
    model.model.layers[1].mlp.register_forward_hook(hook)
    kw = dict(options)
    if bf16:
        model = bf16_model(model)
        kw["autocast"] = bf16_autocast
    from tests.runtime_helpers import new_engine

    eng = new_engine(model, tmp_path / f"off-{speculative}", placements=placements,
                     microbatch_order=order, micro_batches=M, grad_clip=clip,
                     speculative_updates=speculative, **kw)
    assert eng.report.placements == placements
    recs = []
    for i, b in enumerate(batches(STEPS, M, seed=5)):
        hook.armed = i == skip
        recs.append(eng.step(b, LR))
        assert recs[-1]["skipped"] == (i == skip)
    eng.synchronize()
    out = {"losses": [r["loss"] for r in recs], "norms": [r["grad_norm"] for r in recs],
           "weights": eng.weights(), "state": eng.optimizer_state(),
           "generations": [st.generation for st in eng.states if st.tier == Tier.DISK],
           "spare_files": sorted(n for n in eng.store._disk_files if ".spare." in n)}
    eng.close()
    return out


def _assert_equal_runs(got, ref):
    assert got["losses"] == ref["losses"]
    # (a skipped step's norm is NaN on both)
    assert torch.equal(torch.tensor(got["norms"]).nan_to_num(7.0),
                       torch.tensor(ref["norms"]).nan_to_num(7.0)), (got["norms"], ref["norms"])
    assert got["weights"].keys() == ref["weights"].keys()
    for k, v in ref["weights"].items():
        assert torch.equal(got["weights"][k], v), k
    assert got["state"].keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        assert torch.equal(got["state"][k], v), k


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("placed", ["disk", "tiered"])
def test_speculative_updates_are_exact(base, placed, order, regime, tmp_path):
    """On vs off, bit for bit; the speculations ran (the spare files exist) and each kept one
    flipped its segment's generation (3 steps kept: odd; one skipped: even; redone: none)."""
    placements, bf16 = (DISK, False) if placed == "disk" else (TIERED, True)
    # the disk case crosses staging in chunks (the chunked update's writes go to the spare
    # files); the tiered one reads its disk blocks' state ahead during the backward
    kw = ({"staging_chunk_numel": 8192} if placed == "disk"
          else {"readahead": ReadAhead(extra_bytes=1 << 30)})
    ref = _run(base, placements, order, regime, tmp_path, speculative=False, bf16=bf16, **kw)
    got = _run(base, placements, order, regime, tmp_path, speculative=True, bf16=bf16, **kw)
    _assert_equal_runs(got, ref)
    assert ref["spare_files"] == [] and got["spare_files"]
    kept = {"commit": STEPS, "redo": 0, "skip": STEPS - 1}[regime]
    assert got["generations"] == [kept % 2] * len(got["generations"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plan_s_disk_bytes_are_the_ledger_s(precision, tmp_path):
    """With speculative updates the plan's disk bytes (its byte replay plus the spare files,
    `with_speculation`) and the engine's placement report equal what the engine's ledger holds
    on disk, class by class; two steps later too (the spare files are reserved up front). The
    host peak stays within the plan's (which adds the speculations' staging)."""
    from tests.runtime_helpers import OPTIM
    from tierlm.memory.hardware import PROFILES
    from tierlm.models import build_model, preset_config
    from tierlm.plan.evaluate import evaluate, spare_disk_bytes, with_speculation
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime import EngineOptions, build_engine
    from tierlm.runtime.schedule import MOST_HELD_GRADIENTS
    from tierlm.runtime.shapes import ModelShape, TrainShape

    hw = PROFILES["rtx4090"]
    torch.manual_seed(0)
    model = build_model(preset_config("tiny"))
    extra = {}
    if precision == "bf16":
        model = bf16_model(model)
        extra = {"autocast": bf16_autocast}
    shape = ModelShape.from_config(preset_config("tiny"), optim=OPTIM)
    n = len(shape.names)
    # streamed disk blocks with gradient files, resident ones holding theirs on the host
    blocks = [SegmentPlacement(False, Tier.DISK), SegmentPlacement(True, Tier.DISK, Tier.HOST)]
    placements = ([SegmentPlacement(True, Tier.DEVICE)] + [blocks[s % 2] for s in range(n - 2)]
                  + [SegmentPlacement(False, Tier.HOST)])
    train = TrainShape(1, 8, M, precision)
    plain = evaluate(shape, train, hw, placements, "layer-outer", False, usable_budgets(hw))
    predicted = with_speculation(shape, train, hw, plain)
    assert predicted.speculative and predicted.disk_bytes > plain.disk_bytes
    # host RAM holds the most gradients kept for the speculations (counted in the host peak)
    assert predicted.held_gradients == MOST_HELD_GRADIENTS
    eng = build_engine(model, OPTIM, EngineOptions(
        policy="auto", placements=placements, microbatch_order="layer-outer",
        keep_resident_activations=False, offload_dir=str(tmp_path), batch_size=1, seq_len=8,
        micro_batches=M, speculative_updates=True, grad_clip=0.0,
        held_gradients=predicted.held_gradients, **extra),
        device=torch.device("cpu"))
    try:
        led = eng.ledger
        assert eng.report.disk_bytes == led.tier_bytes(Tier.DISK) == predicted.disk_bytes
        for b in batches(2, M, 1, 8):
            eng.step(b, 1e-3)
        eng.synchronize()
        assert led.tier_bytes(Tier.DISK) == predicted.disk_bytes
        # the speculations stage during the backward: within the plan's bound for them
        assert led.peak_tier_bytes[Tier.HOST] <= predicted.host_peak_bytes
        # by class: the plan's one copy per class, the spare files as a class of their own
        spare = spare_disk_bytes(shape, train, placements)
        by_class = {c.value: led.current_bytes[(Tier.DISK, c)] - spare.get(c.value, 0)
                    for c in TensorClass if led.current_bytes[(Tier.DISK, c)]}
        assert {**by_class, "spare": sum(spare.values())} == predicted.disk_by_class
    finally:
        eng.close()


@pytest.mark.parametrize("placed", ["disk", "tiered"])
def test_a_checkpoint_mid_run_resumes_to_the_uninterrupted_run(base, placed, tmp_path):
    """With speculative updates kept, a checkpoint after an odd number of steps reads the
    spare generation's files (the current one then); a new engine loading it and running
    on reaches the uninterrupted run's losses, weights and optimizer state, bit for bit."""
    from tests.runtime_helpers import new_engine
    from tierlm.runtime.state import as_tensor

    placements, bf16 = (DISK, False) if placed == "disk" else (TIERED, True)
    data = batches(STEPS, M, seed=7)

    def engine(where: str):
        model = copy.deepcopy(base)
        kw = {}
        if bf16:
            model = bf16_model(model)
            kw["autocast"] = bf16_autocast
        return new_engine(model, tmp_path / where, placements=placements, micro_batches=M,
                          microbatch_order="layer-outer", grad_clip=1e9,
                          speculative_updates=True, **kw)

    whole = engine("whole")
    ref = [whole.step(b, LR)["loss"] for b in data]
    whole.synchronize()
    ref_weights, ref_state = whole.weights(), whole.optimizer_state()
    whole.close()

    first = engine("first")
    losses = [first.step(data[0], LR)["loss"]]
    first.synchronize()
    assert {st.generation for st in first.states if st.tier == Tier.DISK} == {1}
    weights, optim = {}, {}
    for _, w, o in first.state_shards():  # as a checkpoint writes them
        weights.update({k: as_tensor(v).clone() for k, v in w.items()})
        optim.update({k: as_tensor(v).clone() for k, v in o.items()})
    first.close()
    resumed = engine("resumed")
    resumed.load(weights, optim)
    losses += [resumed.step(b, LR)["loss"] for b in data[1:]]
    resumed.synchronize()
    got = {"losses": losses, "norms": [0.0], "weights": resumed.weights(),
           "state": resumed.optimizer_state()}
    resumed.close()
    _assert_equal_runs(got, {"losses": ref, "norms": [0.0], "weights": ref_weights,
                             "state": ref_state})


def test_the_planner_keeps_them_where_faster_and_the_disk_holds_them():
    """`plan` under --speculative-update auto takes them on a plan with disk-tier state when
    the simulated step gains and the disk budget holds the spare files (and host RAM their
    staging), and not when it does not; on and off force the choice; `Auto` passes it to the
    engine and `tierlm plan` says it in one line."""
    from tests.runtime_helpers import OPTIM
    from tierlm.memory.hardware import PROFILES
    from tierlm.models import preset_config
    from tierlm.plan.describe import describe
    from tierlm.plan.policy import Auto
    from tierlm.plan.result import SAFETY_MARGIN
    from tierlm.plan.search import plan
    from tierlm.runtime import EngineOptions
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("tiny"), optim=OPTIM)
    train = TrainShape(2, 32, 2, "fp32")
    hw = PROFILES["rtx4090"]

    def planned(speculative, profile=hw, host=7 << 20):
        return plan(shape, train, profile, device_budget=32 << 20, host_budget=host,
                    speculative=speculative, advise=False)

    auto, on, off = planned(None), planned(True), planned(False)
    assert auto.fits and auto.speculative and on.speculative and not off.speculative
    assert any(p.state_tier == Tier.DISK for p in off.placements)
    assert auto.times_s["simulated_step"] < auto.times_s["simulated_step_plain"] == \
        off.times_s["simulated_step"]
    assert auto.disk_bytes > off.disk_bytes
    assert Auto(auto).engine_options(EngineOptions()).speculative_updates
    assert not Auto(off).engine_options(EngineOptions()).speculative_updates
    text = describe(auto, shape, train, hw)
    assert sum(line.startswith("speculative updates: on") for line in text.split("\n")) == 1
    # a disk budget between the two: the spare files do not fit, auto keeps them off
    between = (off.disk_bytes + auto.disk_bytes) // 2
    tight = hw.with_overrides(disk_budget_bytes=int(between / (1 - SAFETY_MARGIN)))
    kept = planned(None, tight)
    assert kept.fits and not kept.speculative and kept.disk_bytes == off.disk_bytes
    assert "simulated_step_speculative" in kept.times_s
    # nor where host RAM has no room for their staging during the backward
    short = planned(None, host=6 << 20)
    assert short.fits and not short.speculative
    assert "simulated_step_speculative" in short.times_s


def _counted(base, placements, regime, tmp_path, *, bf16):
    """Each step's `Engine.speculation` and the disk bytes the run moved, its updates
    included, on a speculating engine."""
    from tests.runtime_helpers import new_engine
    from tierlm.memory.tiers import Link

    clip, skip = REGIMES[regime]
    model = copy.deepcopy(base)
    hook = InfGrad()
    model.model.layers[1].mlp.register_forward_hook(hook)
    kw = {}
    if bf16:
        model = bf16_model(model)
        kw["autocast"] = bf16_autocast
    eng = new_engine(model, tmp_path / regime, placements=placements, micro_batches=M,
                     microbatch_order="microbatch-outer", grad_clip=clip,
                     speculative_updates=True, **kw)
    counts = []
    for i, b in enumerate(batches(STEPS, M, seed=5)):
        hook.armed = i == skip
        eng.step(b, LR)
        counts.append(eng.speculation.fields())
    eng.synchronize()
    moved = eng.ledger.total_moved_bytes
    disk = moved[Link.DISK_READ] + moved[Link.DISK_WRITE]
    eng.close()
    return counts, disk


@pytest.mark.parametrize("placed", ["disk", "tiered"])
def test_each_step_counts_its_speculations_kept_redone_or_dropped(base, placed, tmp_path):
    """The step's record of its speculations (metrics.jsonl's speculation_* fields): a clip
    that never binds keeps every one, one that always binds redoes every one, at the disk
    bytes the redos add to the run's (its ledger's, against the run that kept them), and a
    skipped step drops its own."""
    placements, bf16 = (DISK, False) if placed == "disk" else (TIERED, True)
    n = sum(p.state_tier == Tier.DISK for p in placements)

    def expect(kept=0, redone=0, dropped=0, nbytes=0):
        return {"speculated_segments": n, "speculation_kept": kept,
                "speculation_redone": redone, "speculation_dropped": dropped,
                "speculation_redo_disk_bytes": nbytes}

    commit, commit_disk = _counted(base, placements, "commit", tmp_path, bf16=bf16)
    assert commit == [expect(kept=n)] * STEPS
    redo, redo_disk = _counted(base, placements, "redo", tmp_path, bf16=bf16)
    assert [{**c, "speculation_redo_disk_bytes": 0} for c in redo] == [expect(redone=n)] * STEPS
    assert all(c["speculation_redo_disk_bytes"] > 0 for c in redo)
    assert sum(c["speculation_redo_disk_bytes"] for c in redo) == redo_disk - commit_disk
    skip, _ = _counted(base, placements, "skip", tmp_path, bf16=bf16)
    assert skip == [expect(kept=n), expect(dropped=n), expect(kept=n)]


@pytest.mark.parametrize("held", [1, 2])
@pytest.mark.parametrize("placed", ["disk", "tiered"])
def test_the_speculation_takes_the_landed_sum_and_reads_no_gradient_file(base, placed, held,
                                                                         tmp_path):
    """Microbatch-outer over four micro-batches: each disk gradient file's final landing adds
    the last contribution to the file's partial sum, and the speculation takes that complete
    sum from host RAM as it lands. The clip (between the steps' norms) keeps some speculations
    and redoes others from the file, and the run is bit for bit the run without the option
    (a stale or partial gradient in a kept speculation would change its weights). Each kept
    speculation read no gradient file: the run read exactly that much less of them than the
    run without, and no host staging outlives the steps."""
    from tests.runtime_helpers import new_engine
    from tierlm.memory.store import nbytes_of

    placements, bf16 = (DISK, False) if placed == "disk" else (TIERED, True)
    m, steps = 4, 4
    data = batches(steps, m, seed=5)
    # the steps' norms are about 1.21, 1.37, 1.36, 1.40 (equal with the option or without)
    clip = 1.365

    def run(speculative: bool):
        model = copy.deepcopy(base)
        kw = {"staging_chunk_numel": 8192} if placed == "disk" else {}
        if bf16:
            model = bf16_model(model)
            kw["autocast"] = bf16_autocast
        eng = new_engine(model, tmp_path / f"m-{speculative}", placements=placements,
                         microbatch_order="microbatch-outer", micro_batches=m, grad_clip=clip,
                         speculative_updates=speculative, held_gradients=held, **kw)
        read = []  # gradient-file bytes each step read
        real = eng.store.read_file

        def read_file(name, dst, offset_bytes=0):
            if name.endswith("/grad.bin"):
                read[-1] += nbytes_of(dst)
            return real(name, dst, offset_bytes)

        eng.store.read_file = read_file
        recs, kept = [], []
        for b in data:
            read.append(0)
            recs.append(eng.step(b, LR))
            eng.synchronize()  # the step's updates (and reads) are done
            kept.append([st.generation for st in eng.states if st.tier == Tier.DISK])
        out = {"losses": [r["loss"] for r in recs], "norms": [r["grad_norm"] for r in recs],
               "weights": eng.weights(), "state": eng.optimizer_state(), "read": read,
               "generations": kept,
               "staging": eng.ledger.current_bytes[(Tier.HOST, TensorClass.STAGING)],
               "grad_file_bytes": sum(4 * st.numel for st in eng.states
                                      if st.tier == Tier.DISK and st.grad is None)}
        eng.close()
        return out

    ref, got = run(False), run(True)
    _assert_equal_runs(got, ref)
    # a step kept its speculations where the clipping coefficient was 1 (each flips the
    # generations), and the clip made both happen
    gens = got["generations"]
    flips = [[x != y for x, y in zip(a, b, strict=True)]
             for a, b in zip([[0] * len(gens[0])] + gens, gens, strict=False)]
    committed = [all(f) for f in flips]
    assert [not any(f) for f in flips] == [not c for c in committed]
    assert committed == [n <= clip for n in ref["norms"]] and 0 < sum(committed) < steps
    assert got["grad_file_bytes"] > 0
    assert got["read"] == [r - c * got["grad_file_bytes"]
                           for r, c in zip(ref["read"], committed, strict=True)]
    assert got["staging"] == ref["staging"] == 0


@pytest.mark.parametrize("held", [1, 2])
def test_landings_keep_no_more_gradients_than_held_however_far_behind_the_worker(base, held,
                                                                                tmp_path):
    """With the update worker held up at each step's start (a task ahead of the speculations),
    the backward's final landings outrun their speculations: each landing that keeps a
    gradient in host RAM first waits for the speculation `held` before it, so no more than
    `held` are kept at once (as many as the planner's replays hold) and the run stays the
    run without the option."""
    import time

    from tests.runtime_helpers import new_engine

    def run(speculative: bool):
        eng = new_engine(copy.deepcopy(base), tmp_path / f"h-{speculative}", placements=DISK,
                         microbatch_order="layer-outer", micro_batches=M, grad_clip=1e9,
                         staging_chunk_numel=8192, speculative_updates=speculative,
                         held_gradients=held)
        live, most = set(), [0]
        passes, free = eng._file_passes, eng.store.free

        def file_passes(*args):
            kept = passes(*args)
            if kept is not None:
                live.add(id(kept))
                most[0] = max(most[0], len(live))
            return kept

        def store_free(tier, cls, t):
            live.discard(id(t))
            free(tier, cls, t)

        eng._file_passes, eng.store.free = file_passes, store_free
        losses = []
        for b in batches(2, M, seed=3):
            eng._worker.submit(time.sleep, 0.2)
            losses.append(eng.step(b, LR)["loss"])
        eng.synchronize()
        weights = eng.weights()
        eng.close()
        return losses, weights, most[0], live

    ref_losses, ref_weights, _, _ = run(False)
    losses, weights, most, live = run(True)
    assert losses == ref_losses
    assert all(torch.equal(weights[k], v) for k, v in ref_weights.items())
    assert most == held and not live  # the four disk segments' landings outran the worker


@pytest.mark.parametrize("order", ["layer-outer", "microbatch-outer"])
def test_the_byte_replay_holds_the_gradients_the_speculations_keep(order):
    """The byte replay (the plan's host peak) keeps each speculated disk-tier segment's landed
    gradient in host RAM as the engine does, `held_gradients` at most at once: each gradient
    held adds one block's fp32 gradient to the host peak, up to the disk-tier blocks there are
    (the engine's side: test_landings_keep_no_more_gradients_than_held_...)."""
    from tests.runtime_helpers import OPTIM
    from tierlm.models import preset_config
    from tierlm.runtime.byte_replay import _simulate
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("tiny"), optim=OPTIM)
    n = len(shape.names)
    placements = ([SegmentPlacement(True, Tier.DEVICE)]
                  + [SegmentPlacement(False, Tier.DISK)] * (n - 2)
                  + [SegmentPlacement(False, Tier.HOST)])
    train = TrainShape(1, 8, M, "fp32")

    def host_peak(speculative: bool, held: int) -> int:
        ledger, _, _ = _simulate(shape, train, placements, order, False, False,
                                 speculative=speculative, held_gradients=held)
        return ledger.peak_tier_bytes[Tier.HOST]

    grad = 4 * shape.numels[1]  # a block's fp32 gradient (the blocks are alike)
    plain = host_peak(False, 1)
    assert [host_peak(True, held) - plain for held in range(1, n)] == [
        grad * min(held, n - 2) for held in range(1, n)]


@pytest.mark.parametrize("order", ["layer-outer", "microbatch-outer"])
def test_a_speculating_step_reads_ahead_in_the_order_its_gradients_complete(base, order,
                                                                            tmp_path,
                                                                            monkeypatch):
    """Speculative updates start as the backward completes each gradient, the last segment
    first, so the update read-ahead goes in that order and leaves out a segment whose update
    has started: with room for one block's master and slots, it reads the last block's (the
    head's update starts with the backward, before any read-ahead could), which its update
    then finds in RAM. In forward order it read the embedding's, whose update comes last, or,
    as here, stopped at it."""
    from tests.runtime_helpers import new_engine
    from tierlm.runtime.update import Updates

    found = []
    real = Updates._run_speculation

    def record(self, st, landed, to, ahead, lr):
        found.append((st.index, ahead is not None))
        return real(self, st, landed, to, ahead, lr)

    monkeypatch.setattr(Updates, "_run_speculation", record)

    def engine(name, extra):
        return new_engine(copy.deepcopy(base), tmp_path / name, placements=DISK,
                          microbatch_order=order, micro_batches=M, grad_clip=1e9,
                          speculative_updates=True, readahead=ReadAhead(extra_bytes=extra))

    probe = engine("probe", 0)
    block = probe.states[2]
    room = sum(block.slot(c).nbytes(block.layout) for c in block.state_copies)
    probe.close()
    eng = engine("run", room)
    assert sorted(s for segs in eng.readahead_plan(eng.schedule(M)).values()
                  for s in segs) == [2]
    for b in batches(2, M, seed=5):
        eng.step(b, LR)
    eng.synchronize()
    eng.close()
    assert found == [(3, False), (2, True), (1, False), (0, False)] * 2

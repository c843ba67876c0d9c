"""The tiered runtime reproduces the reference trainer (ARCHITECTURE.md invariant 1), keeps its
budgets (invariant 2), and moves the bytes the schedule says."""

import copy
import itertools
import threading
import time

import pytest
import torch

from tests.runtime_helpers import (
    OPTIM,
    InfGrad,
    assert_close_run,
    batches,
    reference_cases,
    tiny_model,
)
from tierlm.memory import PlacementError, Tier
from tierlm.memory.placement import COMPUTE_B, SegmentPlacement
from tierlm.memory.tiers import Link
from tierlm.models.adapters import ModelAdapter
from tierlm.runtime import Engine
from tierlm.runtime.placement import place
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.state import as_tensor
from tierlm.runtime.writeback import WriteBack

CPU = torch.device("cpu")
STEPS, B, T = 5, 2, 16


def segment_numels(model) -> dict[str, int]:
    return {s.name: sum(p.numel() for _, p, _ in s.params) for s in ModelAdapter(model).segments}


def tiered_budget(model, m: int, order: str) -> int:
    """A device budget that keeps embed, head and the last block resident and streams the rest."""
    numels = segment_numels(model)
    names, sizes = list(numels), list(numels.values())
    hidden = B * T * model.config.hidden_size * 4
    act = Engine.boundary_activation_bytes(len(names), hidden, m, order)
    streamed_all = place(names, sizes, policy="host", activation_bytes=act).device_bytes
    keep = ("embed", "head", names[-2])
    return streamed_all + sum(16 * numels[n] for n in keep)


@pytest.fixture(scope="module")
def references():
    return reference_cases(STEPS)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("policy", ["none", "host", "disk", "tiered"])
@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_matches_reference(references, name, policy, order, m, clip, tmp_path, make_engine):
    base, steps, lrs, ref_recs, ref_weights = references[(name, m, clip)]
    model = copy.deepcopy(base)
    budget = tiered_budget(model, m, order) if policy == "tiered" else None
    eng = make_engine(
        model, policy=policy, microbatch_order=order, grad_clip=clip,
        micro_batches=m, device_budget_bytes=budget,
    )
    if policy == "tiered":  # the budget really mixes resident and streamed segments
        assert {p.resident for p in eng.report.placements} == {True, False}
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    if clip:
        assert all(r["grad_norm"] > clip for r in recs)  # clipping is active on every step
    weights = eng.weights()
    eng.close()
    assert_close_run(
        [r["loss"] for r in recs], [r["loss"] for r in ref_recs], weights, ref_weights
    )
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("policy", ["none", "host", "disk"])
def test_inf_gradient_skips_the_step_on_both_sides(policy, tmp_path, make_engine):
    base = tiny_model("llama_tied_gqa", layers=2)
    steps = batches(4, 2)
    lrs = [OPTIM.lr] * 4

    def run(model, stepper):
        hook = InfGrad()
        model.model.layers[1].mlp.register_forward_hook(hook)
        recs = []
        for i, (b, lr) in enumerate(zip(steps, lrs, strict=True)):
            hook.armed = i == 2
            if i == 2:  # clones: a snapshot that shares storage with the weights cannot differ
                before = [{k: v.clone() for k, v in state.items()}
                          for state in (stepper.weights(), stepper.optimizer_state())]
            recs.append(stepper.step(b, lr))
            if i == 2:
                after = [stepper.weights(), stepper.optimizer_state()]
                for b_state, a_state in zip(before, after, strict=True):
                    assert b_state.keys() == a_state.keys()
                    unequal = [k for k in b_state if not torch.equal(b_state[k], a_state[k])]
                    assert not unequal, f"{type(stepper).__name__} changed {unequal[:3]}"
        return recs, stepper.weights()

    from tierlm.runtime.reference import ReferenceStep

    ref_model = copy.deepcopy(base)
    ref = ReferenceStep(ref_model, OPTIM, grad_clip=1.0, device=CPU)
    ref_recs, ref_w = run(ref_model, ref)
    model = copy.deepcopy(base)
    eng = make_engine(model, policy=policy, micro_batches=2)
    recs, w = run(model, eng)
    assert [r["skipped"] for r in recs] == [False, False, True, False]
    assert [r["skipped"] for r in ref_recs] == [False, False, True, False]
    assert eng.skipped_steps == ref.skipped_steps == 1
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)
    eng.close()


def test_device_budget_of_two_blocks_holds(tmp_path, make_engine):
    """Host state, every segment streamed: the device holds two blocks' compute weights (the one
    running and the one prefetched), two blocks' gradients (one accumulating, the one before
    still landing into host RAM), and the boundary activations."""
    model = tiny_model("llama_untied", layers=4)
    numels = segment_numels(model)
    block = numels["block.0"]
    assert block > max(numels["embed"], numels["head"])
    hidden = B * T * model.config.hidden_size * 4
    n_segs = len(numels)
    activations = (n_segs - 1 + 2) * hidden  # inputs of all segments after embed, + 2 grads
    budget = 2 * block * COMPUTE_B + 2 * block * 4 + activations
    eng = make_engine(model, policy="host", device_budget_bytes=budget, micro_batches=1)
    assert eng.report.device_bytes == budget
    for b in batches(3, 1):
        eng.step(b, OPTIM.lr)
        peak = eng.ledger.step_peak_tier_bytes[Tier.DEVICE]
        assert peak <= budget
        # the streaming window was really used: two blocks and two block gradients at once
        assert peak >= 4 * block * 4
    assert eng.ledger.peak_tier_bytes[Tier.DEVICE] <= budget
    eng.close()
    with pytest.raises(PlacementError, match=r"device needs .* but --device-budget is"):
        make_engine(tiny_model("llama_untied", layers=4), policy="host",
                    device_budget_bytes=budget - 1)


@pytest.mark.parametrize("m", [2, 4])
def test_layer_outer_moves_weights_once_microbatch_outer_per_microbatch(m, tmp_path, make_engine):
    """Blocks streamed from host, embed and head resident, a cache of two block slots.

    layer-outer: the forward loads each of the L blocks once; the backward finds the last two
    still on the device and loads the other L-2: 2L-2 block loads per step, whatever M is.
    microbatch-outer: the first micro-batch costs the same 2L-2; each further one finds two
    blocks cached at both turns and loads 2L-4 more. Gradients leave the device once per block
    per step with layer-outer, once per block per micro-batch with microbatch-outer.
    """
    layers = 4
    moved = {}
    for order in ("layer-outer", "microbatch-outer"):
        model = tiny_model("llama_untied", layers=layers)
        block_bytes = segment_numels(model)["block.0"] * 4
        eng = make_engine(
            model, tmp_path / order / "offload", policy="host", resident="embed|head",
            microbatch_order=order, micro_batches=m,
        )
        for b in batches(2, m):
            eng.step(b, OPTIM.lr)  # the second step is measured (steady state)
        moved[order] = (eng.ledger.moved_bytes[Link.H2D], eng.ledger.moved_bytes[Link.D2H])
        eng.close()
    numels = segment_numels(tiny_model("llama_untied", layers=layers))
    # embed and head are resident with host state: their device copies are refreshed once per
    # step after the update, and their gradients leave the device like the blocks'.
    resident_bytes = (numels["embed"] + numels["head"]) * 4
    head_embed_grad = resident_bytes
    assert moved["layer-outer"][0] == (2 * layers - 2) * block_bytes + resident_bytes
    assert moved["microbatch-outer"][0] == (
        (2 * layers - 2) + (m - 1) * (2 * layers - 4)
    ) * block_bytes + resident_bytes
    assert moved["layer-outer"][1] == layers * block_bytes + head_embed_grad
    assert moved["microbatch-outer"][1] == m * (layers * block_bytes + head_embed_grad)


def test_disk_tier_files_hold_the_state(tmp_path, make_engine):
    model = tiny_model("gpt2", layers=2)
    numels = segment_numels(model)
    eng = make_engine(model, policy="disk")
    files = sorted(p.relative_to(tmp_path / "offload").as_posix()
                   for p in (tmp_path / "offload").rglob("*.bin"))
    assert files == sorted(f"{s}/{c}.bin" for s in numels
                           for c in ("exp_avg", "exp_avg_sq", "grad", "master"))
    total = sum(numels.values())
    assert eng.ledger.tier_bytes(Tier.DISK) == 16 * total
    assert eng.ledger.tier_bytes(Tier.HOST) == 0  # staging is freed between uses
    eng.step(batches(1, 1)[0], OPTIM.lr)
    eng.synchronize()
    snap = eng.ledger.snapshot()
    # the forward reads every master once, the update master, grad, m and v (the backward
    # re-reads what the cache dropped)
    assert snap["disk_read_bytes"] >= 5 * 4 * total
    assert snap["disk_write_bytes"] == 4 * 4 * total  # grad written, master, m, v written back
    eng.close()


def test_placement_refuses_with_numbers_and_a_hint():
    with pytest.raises(PlacementError, match=r"host needs .* --host-budget is .*disk"):
        place(["embed", "block.0", "head"], [1000, 5000, 1000], policy="host",
              host_budget_bytes=1000)


def test_tiered_spills_to_disk_under_a_host_budget():
    names = ["embed", "block.0", "block.1", "block.2", "head"]
    numels = [1000, 10_000, 10_000, 10_000, 1000]
    rep = place(names, numels, policy="tiered", device_budget_bytes=200_000,
                host_budget_bytes=400_000,
                slot_bytes=[8 * n for n in numels])  # AdamW's two moments
    tiers = [p.state_tier for p in rep.placements]
    assert Tier.DISK in tiers and rep.host_bytes <= 400_000 and rep.device_bytes <= 200_000
    assert rep.placements[0].state_tier == Tier.DEVICE  # embed is kept first


@pytest.mark.parametrize("policy", ["none", "host", "disk"])
def test_sampling_logits_stream_the_segments(policy, tmp_path, make_engine):
    """The end-of-run sample's forward runs through the runtime (no whole model is built): its
    last-position logits equal the plain model's on the same weights."""
    base = tiny_model("llama_tied_gqa", layers=2)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, base.config.vocab_size, (1, 12), generator=g)
    with torch.no_grad():
        expected = base.eval()(input_ids=ids).logits[0, -1]
    eng = make_engine(copy.deepcopy(base).train(), policy=policy)
    got = eng.next_token_logits(ids)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert all(p.numel() == 0 for p in eng.adapter.model.parameters())  # nothing materialised
    eng.close()


@pytest.mark.parametrize("writeback", [None, WriteBack(segments=2)], ids=["inside", "behind2"])
@pytest.mark.parametrize(("m", "clip"), [(1, 0.0), (4, 0.05)], ids=["m1-noclip", "m4-clip"])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("mode", ["host-grads", "readahead", "both"])
def test_disk_tier_options_match_reference(references, mode, order, m, clip, writeback,
                                           tmp_path, make_engine):
    """Disk-tier state with its gradient held in host RAM, with the update's master and slots
    read ahead during the backward (a budget covering the embedding and the first block, so
    the later segments update the usual way), and both: the reference's losses and weights,
    no gradient file where the gradient is held on the host, and the read-ahead's reads of the
    slot files issued in the sweep, none by the update of a segment read ahead. The write-back
    inside the update, or behind the step (two segments pending; the default, one, runs in
    test_matches_reference)."""
    base, steps, lrs, ref_recs, ref_weights = references[("llama_tied_gqa", m, clip)]
    model = copy.deepcopy(base)
    numels = segment_numels(model)
    grad_tier = None if mode == "readahead" else Tier.HOST
    placements = [SegmentPlacement(False, Tier.DISK, grad_tier)] * len(numels)
    first_two = 12 * sum(list(numels.values())[:2])  # master + both moments
    readahead = None if mode == "host-grads" else ReadAhead(extra_bytes=first_two)
    eng = make_engine(model, policy="disk", placements=placements,
                      microbatch_order=order, grad_clip=clip, micro_batches=m,
                      readahead=readahead, writeback=writeback)
    phase, slot_reads = ["sweep"], []
    read_file, finish_step = eng.store.read_file, eng._finish_step

    def spy_read(name, dst, offset=0):
        if name.endswith("exp_avg.bin"):
            slot_reads.append((phase[0], name.split("/")[0]))
        return read_file(name, dst, offset)

    def spy_finish(lr):
        phase[0] = "update"
        return finish_step(lr)

    eng.store.read_file, eng._finish_step = spy_read, spy_finish
    recs = []
    for b, lr in zip(steps, lrs, strict=True):
        phase[0] = "sweep"
        recs.append(eng.step(b, lr))
        eng.synchronize()  # the update's reads are the update's, not the next sweep's
    weights = eng.weights()
    offload = tmp_path / "offload"
    eng.close()
    assert_close_run(
        [r["loss"] for r in recs], [r["loss"] for r in ref_recs], weights, ref_weights
    )
    assert any(offload.rglob("grad.bin")) == (grad_tier is None)
    ahead = {"embed", "block.0"} if readahead else set()
    assert {s for p, s in slot_reads if p == "sweep"} == ahead
    assert {s for p, s in slot_reads if p == "update"} == set(numels) - ahead


def _slow_writeback(eng, delay_s: float, fail: str | None = None,
                    gate: threading.Event | None = None, clock=None) -> dict:
    """Delay every write the write-back thread makes by `delay_s` (or fail those of files ending
    in `fail`; or hold it until `gate` opens, for at most a hang guard); returns {segment name:
    [`clock()` when each of its write-backs ended]}."""
    write_file, ended = eng.store.write_file, {}
    clock = clock or time.perf_counter

    def slow(name, src, cls, offset=None):
        if threading.current_thread().name.startswith("tierlm-writeback"):
            if fail and name.endswith(fail):
                raise OSError(f"injected: {name}")
            time.sleep(delay_s)
            if gate is not None and not gate.wait(timeout=30):
                gate.set()  # a hang guard: the forward never came; the test fails below
            out = write_file(name, src, cls, offset)
            out.result()
            ended.setdefault(name.split("/")[0], []).append(clock())
            return out
        return write_file(name, src, cls, offset)

    eng.store.write_file = slow
    return ended


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_forward_starts_before_its_segments_write_back_ends(order, tmp_path, make_engine):
    """With the write-back behind the step, a segment's next forward runs while its master and
    slots are still being written (here: every write-back write held until the second step's
    first forward begins; an engine that waited for them would never open the gate), and the
    weights are bit for bit those of the write-back inside the update. Events are ordered by a
    counter, not timed."""
    base = tiny_model("llama_tied_gqa", layers=2)
    steps = batches(2, 2)
    runs = {}
    ticks = itertools.count()
    for wb in (None, WriteBack(segments=1)):
        eng = make_engine(copy.deepcopy(base), tmp_path / str(wb) / "offload", policy="disk",
                          microbatch_order=order, micro_batches=2, writeback=wb)
        gate = threading.Event() if wb is not None else None
        ended = _slow_writeback(eng, 0.0, gate=gate, clock=lambda: next(ticks))
        forward, started, in_step = eng._forward, {}, [0]

        def spy(a, mbs, w, forward=forward, started=started, eng=eng, gate=gate,
                in_step=in_step):
            if gate is not None and in_step[0] == 2:
                gate.set()
            started.setdefault(eng.states[a.seg].seg.name, []).append(next(ticks))
            return forward(a, mbs, w)

        eng._forward = spy
        for b in steps:
            in_step[0] += 1
            eng.step(b, 1e-3)
        runs[wb] = eng.weights()
        eng.close()
    # each segment's first forward of the second step against the end of its first write-back
    early = [name for name, ends in ended.items() if name in started
             and started[name][len(started[name]) // 2] < ends[0]]
    assert early  # the second step's forward of these began before the first write-back ended
    assert runs[None].keys() == runs[WriteBack(segments=1)].keys()
    for k, v in runs[None].items():
        assert torch.equal(v, runs[WriteBack(segments=1)][k]), k


def test_a_failed_write_back_raises_in_the_training_thread(tmp_path, make_engine):
    eng = make_engine(tiny_model("llama_tied_gqa", layers=2), policy="disk")
    _slow_writeback(eng, 0.0, fail="exp_avg.bin")
    eng.step(batches(1, 1)[0], 1e-3)
    with pytest.raises(OSError, match="injected"):
        eng.synchronize()


@pytest.mark.parametrize("readahead", [None, ReadAhead(extra_bytes=2**30)], ids=["plain", "ahead"])
def test_state_taken_right_after_a_step_is_written_and_resumes_exactly(readahead, tmp_path,
                                                                       make_engine):
    """A checkpoint's shards taken right after a step, its write-backs still in flight (all
    segments pending, each write delayed), hold the updated state: equal to a host-state run's,
    and a disk-state run loaded from them continues bit for bit."""
    base = tiny_model("llama_tied_gqa", layers=2)
    steps, m = batches(4, 2), 2
    straight = make_engine(copy.deepcopy(base), tmp_path / "host" / "offload", policy="host",
                           micro_batches=m)
    half = {}
    for k, b in enumerate(steps):
        straight.step(b, 1e-3)
        if k == 1:
            half = {**straight.weights(), **straight.optimizer_state()}
    want = {**straight.weights(), **straight.optimizer_state()}
    straight.close()

    def disk_engine(path):
        return make_engine(copy.deepcopy(base), path / "offload", policy="disk", micro_batches=m,
                           readahead=readahead, writeback=WriteBack(segments=8))

    first = disk_engine(tmp_path / "first")
    _slow_writeback(first, 0.05)
    for b in steps[:2]:
        first.step(b, 1e-3)
    weights, optim = {}, {}
    for _, w, o in first.state_shards():  # right after the step
        weights.update({k: as_tensor(v).clone() for k, v in w.items()})
        optim.update({k: as_tensor(v).clone() for k, v in o.items()})
    first.close()
    for k, v in half.items():
        got = weights[k] if k in weights else optim[k]
        assert torch.equal(got.reshape(v.shape), v), k
    resumed = disk_engine(tmp_path / "resumed")
    resumed.load(weights, optim)
    for b in steps[2:]:
        resumed.step(b, 1e-3)
    got = {**resumed.weights(), **resumed.optimizer_state()}
    resumed.close()
    for k, v in want.items():
        assert torch.equal(got[k], v), k

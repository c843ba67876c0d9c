"""The planner's keep / offload / recompute choice per streamed segment (tierlm.plan.offload):
the blocks that would recompute hold their saved tensors in host RAM instead where host RAM
holds them and the simulated step is faster (the links have slack under the compute), and
nowhere else; the engine runs exactly that choice, with the reference trainer's losses and
weights, one forward per micro-batch for an offloaded block (two for a recomputed one), and the
pinned arena its plan sized holding the ledger's pinned peak."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.runtime_helpers import (
    OPTIM,
    assert_close_run,
    batches,
    count_forwards,
    new_engine,
    reference_run,
    tiny_model,
)
from tierlm.memory.arena import footprint_bytes
from tierlm.memory.hardware import PROFILES
from tierlm.memory.tiers import TensorClass
from tierlm.plan.describe import describe
from tierlm.plan.evaluate import evaluate, simulated_times
from tierlm.plan.policy import Auto
from tierlm.plan.search import plan
from tierlm.runtime.options import EngineOptions
from tierlm.runtime.shapes import ModelShape, TrainShape, block_saved_storage_bytes

STEPS, M, B, T, CLIP = 2, 2, 2, 16, 0.05
ORDER = "microbatch-outer"
# a GPU slow enough that a block's recompute takes longer than copying its saved tensors out
# and back: the links have slack under the compute
SLOW = dataclasses.replace(PROFILES["rtx4090"], matmul_flops=1e8, fp32_matmul_flops=1e8)
FAST = PROFILES["rtx4090"]  # the copies would stall a compute that recomputes in microseconds
DEVICE = 1500 << 10  # streams blocks 0-2; room for one block's saved tensors beyond the plan
HOST = 100_000 << 10
OFFLOADED = (False, True, True, True, False, False)


@pytest.fixture(scope="module")
def case():
    base = tiny_model("llama_tied_gqa", layers=4)
    shape = ModelShape.from_config(copy.deepcopy(base.config), optim=OPTIM)
    return base, shape, TrainShape(B, T, M, "fp32")


def _plan(shape, train, hw, host=HOST):
    return plan(shape, train, hw, device_budget=DEVICE, host_budget=host, orders=(ORDER,),
                advise=False)


def _recomputing(shape, train, hw, p):
    """`p`'s placement with its offloaded blocks recomputing instead (simulated)."""
    q = evaluate(shape, train, hw, p.placements, p.order, p.keep_resident_activations,
                 p.budgets, p.boundary_on_host, readahead=p.readahead, writeback=p.writeback)
    q.times_s.update(simulated_times(shape, train, hw, q))
    return q


def test_the_planner_offloads_where_host_ram_holds_them_and_the_link_has_slack(case):
    _, shape, train = case
    p = _plan(shape, train, SLOW)
    assert p.fits and p.offload_graphs == OFFLOADED
    assert [q.resident for q in p.placements] == [True, False, False, False, True, True]
    # the simulated step it chose is faster than the same plan recomputing those blocks
    recompute = _recomputing(shape, train, SLOW, p)
    assert recompute.fits and p.times_s["step"] < recompute.times_s["simulated_step"]
    # the byte model: the offloaded blocks' buffers (one micro-batch in flight; a buffer per
    # saved storage) pinned on the host, and one block's saved tensors more on the device
    # while the next come back
    storages = block_saved_storage_bytes(shape.model_config, "fp32", B, T)
    block = int(shape.saved_bytes_per_token("fp32") * B * T)
    assert sum(storages) == block
    one = sum(footprint_bytes(n) for n in storages)
    assert p.pinned_by_class["activation"] == 3 * one
    assert p.pinned_peak_bytes - recompute.pinned_peak_bytes == 3 * one
    assert p.host_peak_bytes - recompute.host_peak_bytes == 3 * block
    assert p.workspace_bytes - recompute.workspace_bytes == block
    text = describe(p, shape, train, SLOW)
    assert ("of 3 streamed segments 0 keep their graph, 3 offload their saved tensors to host "
            "RAM, 0 recompute") in text


def test_the_planner_offloads_only_what_host_ram_holds(case):
    _, shape, train = case
    p = _plan(shape, train, SLOW)
    recompute = _recomputing(shape, train, SLOW, p)
    # host RAM for the plan without offload and not one block's buffer more: none offloads
    none = _plan(shape, train, SLOW, host=int(recompute.host_peak_bytes / 0.9) + 1)
    assert none.fits and none.offload_graphs == () and none.placements == p.placements
    # (block 2 keeps its graph in the device room the offload's copies back would take)
    assert keeps(none) == (True, False, False, True, True, True)
    assert none.times_s["step"] > p.times_s["step"]
    # room for two blocks' buffers: the last two streamed blocks offload, block 0 recomputes
    block = int(shape.saved_bytes_per_token("fp32") * B * T)
    two = _plan(shape, train, SLOW,
                host=int((recompute.host_peak_bytes + 2 * block + 8192) / 0.9) + 1)
    assert two.offload_graphs == (False, False, True, True, False, False)


def test_the_planner_recomputes_where_the_copies_cost_more(case):
    _, shape, train = case
    p = _plan(shape, train, FAST)
    assert p.fits and p.offload_graphs == ()
    assert "offload their saved tensors" not in describe(p, shape, train, FAST)


def keeps(p) -> tuple:
    from tierlm.memory.placement import keeps_graph

    return tuple(keeps_graph(p.placements, p.keep_resident_activations))


def test_the_engine_runs_the_planners_choice_exactly(case, tmp_path):
    """`--offload-policy auto` without an activation policy: the plan's offloaded blocks run
    `offload` (one forward per micro-batch), its kept ones `keep`, the rest `full` (two);
    losses and weights are the reference trainer's; the arena the plan sized before the step
    is the ledger's pinned peak (the offloaded buffers included)."""
    base, shape, train = case
    p = _plan(shape, train, SLOW)
    steps = batches(STEPS, M, B, T)
    ref_recs, ref_w = reference_run(copy.deepcopy(base), steps, [OPTIM.lr] * STEPS, CLIP)
    opts = Auto(p).engine_options(EngineOptions(
        policy="auto", batch_size=B, seq_len=T, micro_batches=M, grad_clip=CLIP))
    eng = new_engine(copy.deepcopy(base), tmp_path, **{
        f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
        if f.name not in ("offload_dir",)})
    assert eng.activation_policies == ["keep", "offload", "offload", "offload", "keep"]
    calls = count_forwards(eng)
    recs, per_step = [], []
    for b in steps:
        before = dict(calls)
        recs.append(eng.step(b, OPTIM.lr))
        per_step.append({k: calls[k] - before[k] for k in calls})
    eng.synchronize()
    w = eng.weights()
    led, arena = eng.ledger, eng.store.arena
    try:
        assert per_step == [{s: M for s in calls}] * STEPS  # no segment recomputes
        assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)
        # the plan's pinned bytes (with the measured offload buffers) are the ledger's peak
        assert led.pinned_peak_bytes == arena.peak_bytes == arena.capacity_bytes == (
            eng.report.pinned.total_bytes)
        offloaded = led.pinned_class_peak_bytes[TensorClass.ACTIVATION]
        assert offloaded == sum(footprint_bytes(n) for s in (1, 2, 3)
                                for n in eng.plan.offload_bytes[s])
        # `tierlm plan`'s own estimate: the storages the engine measured, the same pinned peak
        # and arena
        assert all(eng.plan.offload_bytes[s] == block_saved_storage_bytes(
            shape.model_config, "fp32", B, T) for s in (1, 2, 3))
        assert p.pinned_by_class["activation"] == offloaded
        assert p.pinned_peak_bytes == led.pinned_peak_bytes
        assert p.pinned_arena_bytes == arena.capacity_bytes
    finally:
        eng.close()
    # the same plan without its offload choice: the three blocks recompute, the same math
    rec = new_engine(copy.deepcopy(base), tmp_path / "recompute", **{
        f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
        if f.name not in ("offload_dir", "offload_graphs")})
    calls = count_forwards(rec)
    for b in steps:
        rec.step(b, OPTIM.lr)
    rec.close()
    assert rec.activation_policies == ["keep", "full", "full", "full", "keep"]
    assert calls["block.0"] == calls["block.2"] == 2 * M * STEPS
    assert torch.is_tensor(w["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def reference(case):
    base = case[0]
    steps = batches(STEPS, M, B, T)
    return steps, *reference_run(copy.deepcopy(base), steps, [OPTIM.lr] * STEPS, CLIP)


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_keep_offload_and_recompute_side_by_side_match_the_reference(
        case, reference, placement, order, tmp_path):
    """A plan's flags per segment (activations None: planned) on every streamed placement and
    order: the recomputed segments run their forward twice per micro-batch, the offloaded and
    kept ones once; losses and weights are the reference trainer's."""
    base = case[0]
    steps, ref_recs, ref_w = reference
    eng = new_engine(copy.deepcopy(base), tmp_path, policy=placement, microbatch_order=order,
                     grad_clip=CLIP, micro_batches=M,
                     keep_resident_activations=(False, False, False, False, True, False),
                     offload_graphs=(False, False, True, True, False, False))
    assert eng.activation_policies == ["full", "full", "offload", "offload", "keep"]
    calls = count_forwards(eng)
    recs = [eng.step(b, OPTIM.lr) for b in steps]
    w = eng.weights()
    eng.close()
    assert calls == {"embed": 2 * M * STEPS, "block.0": 2 * M * STEPS, "block.1": M * STEPS,
                     "block.2": M * STEPS, "block.3": M * STEPS, "head": M * STEPS}
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)

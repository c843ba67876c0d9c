"""`--grad-checkpointing none` on a streamed placement: a streamed segment keeps its graph where
the device budget holds it (the weights leave the device after the forward and come back for a
backward that runs without a recompute), and recomputes only where it does not. Counted: each
segment's forward calls per step; checked: the reference trainer's losses and weights, and the
ledger's activation bytes per segment against the plan's measured costs."""

from __future__ import annotations

import copy

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
from tierlm.config import ActivationConfig

CPU = torch.device("cpu")
STEPS, M, CLIP = 2, 2, 0.05


@pytest.fixture(scope="module")
def reference():
    base = tiny_model("llama_tied_gqa", layers=3)
    steps = batches(STEPS, M)
    recs, weights = reference_run(copy.deepcopy(base), steps, [OPTIM.lr] * STEPS, CLIP)
    return base, steps, recs, weights


def engine(model, tmp_path, placement, order, *, budget=None, fallback="full",
           activations=True):
    acts = ActivationConfig(policy="none", dynamic_fallback=fallback) if activations else None
    return new_engine(model, tmp_path, policy=placement, microbatch_order=order, grad_clip=CLIP,
                      micro_batches=M, activations=acts, device_budget_bytes=budget)


def run_counted(eng, steps):
    calls = count_forwards(eng)
    per_step, recs = [], []
    for b in steps:
        before = dict(calls)
        recs.append(eng.step(b, OPTIM.lr))
        per_step.append({k: calls[k] - before[k] for k in calls})
    return recs, per_step


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_streamed_segments_keep_their_graph_and_match_the_reference(
        reference, placement, order, tmp_path):
    base, steps, ref_recs, ref_w = reference
    eng = engine(copy.deepcopy(base), tmp_path, placement, order)
    assert all(not p.resident for p in eng.report.placements[1:-1])  # the blocks stream
    assert eng.activation_policies == ["keep"] * 4
    recs, per_step = run_counted(eng, steps)
    w = eng.weights()
    eng.close()
    # one forward per segment and micro-batch: no recompute
    assert per_step == [{s: M for s in per_step[0]}] * STEPS
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)

    # the planner's rule (streamed segments recompute): the same math, one more forward each
    planned = engine(copy.deepcopy(base), tmp_path / "planned", placement, order,
                     activations=False)
    assert planned.activation_policies == [
        "keep" if p.resident else "full" for p in planned.report.placements[:-1]]
    assert planned.activation_policies[1:] == ["full"] * 3
    precs, pper = run_counted(planned, steps)
    pw = planned.weights()
    planned.close()
    for counts in pper:
        for i, (name, n) in enumerate(counts.items()):
            recomputes = i < len(planned.activation_policies) and (
                planned.activation_policies[i] == "full")
            assert n == M * (2 if recomputes else 1), (name, counts)
    assert [r["loss"] for r in precs] == [r["loss"] for r in recs]
    assert all(torch.equal(pw[k], w[k]) for k in w)


@pytest.mark.parametrize("fallback", ["full", "offload"])
def test_a_budget_keeps_the_last_blocks_and_the_ledger_holds_what_the_plan_measured(
        reference, fallback, tmp_path):
    """A device budget that holds one block's saved tensors: the last block keeps, the others
    take the fallback (recompute, or their saved tensors in host RAM); per segment the ledger's
    activation bytes are the plan's measured costs exactly."""
    base, steps, ref_recs, ref_w = reference
    free = engine(copy.deepcopy(base), tmp_path / "free", "host", "microbatch-outer")
    state = free.report.device_bytes  # streamed slots, boundary activations
    free.close()
    probe = engine(copy.deepcopy(base), tmp_path / "probe", "host", "microbatch-outer",
                   budget=10 * state)
    costs, head = probe.activation_costs, probe.activation_head_bytes
    assert costs is not None and probe.activation_policies == ["keep"] * 4
    probe.close()
    block = costs[1].keep_bytes
    # one block's saved tensors and the head's workspace, not two blocks'
    budget = state + block + head
    eng = engine(copy.deepcopy(base), tmp_path / "tight", "host", "microbatch-outer",
                 budget=budget, fallback=fallback)
    assert eng.activation_policies == ["keep", fallback, fallback, "keep"]
    recs, per_step = run_counted(eng, steps)
    w = eng.weights()
    acts = eng.ledger.segment_activations()  # the last step's peaks per segment and kind
    eng.close()
    recompute = 2 if fallback == "full" else 1
    assert per_step[-1] == {"embed": M, "block.0": recompute * M, "block.1": recompute * M,
                            "block.2": M, "head": M}
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)
    # microbatch-outer: one micro-batch in flight
    assert acts["block.2"].get("saved", 0) == costs[3].keep_bytes
    for name, c in (("block.0", costs[1]), ("block.1", costs[2])):
        assert acts[name].get("saved", 0) == 0
        if fallback == "full":  # the re-run saves what a kept graph would, for its backward
            assert acts[name]["workspace"] == c.workspace("full") == c.keep_bytes
        else:  # held in host RAM from the forward to the backward
            assert acts[name]["offloaded"] == c.keep_bytes


# -- the planner: streamed blocks keep where its byte model finds room ----------------------------


def test_the_planner_keeps_streamed_graphs_last_first_where_the_device_has_room():
    from tierlm.memory.hardware import resolve
    from tierlm.memory.placement import SegmentPlacement, keeps_graph
    from tierlm.memory.tiers import Tier
    from tierlm.models import preset_config
    from tierlm.plan.describe import describe
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.plan.search import _keep_streamed
    from tierlm.runtime.byte_replay import activation_workspace_bytes
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("125m", max_seq_len=512))
    train = TrainShape(batch_size=2, seq_len=256, micro_batches=1, precision="fp32")
    hw = resolve("rtx4090")
    n = len(shape.names)
    streamed = [SegmentPlacement(False, Tier.HOST)] * n
    roomy = usable_budgets(hw)
    base = evaluate(shape, train, hw, streamed, "microbatch-outer", True, roomy)
    assert base.fits and keeps_graph(base.placements, True) == [False] * n
    block = activation_workspace_bytes(shape, train, [False] + [True] + [False] * (n - 3),
                                       "microbatch-outer")
    none = activation_workspace_bytes(shape, train, [False] * (n - 1), "microbatch-outer")
    one_block = block - none  # what keeping a block's graph adds to the workspace peak
    assert one_block > 0
    # room for every block: none recomputes, and the step gets faster
    every = _keep_streamed(shape, train, hw, base, roomy)
    # (embed keeps for free: it saves only its token ids)
    assert every.keep_resident_activations == tuple([True] * (n - 1) + [False])
    # the compute loses its recompute; this step is bound by its copies, which stay
    assert every.times_s["compute"] < base.times_s["compute"] and every.step_s <= base.step_s
    assert "13 of 13 streamed segments keep theirs" in describe(every, shape, train, hw)
    # room for three blocks beyond the plan's device bytes: the last three keep
    tight = dict(roomy, device=base.device_total_bytes + 3 * one_block)
    three = _keep_streamed(shape, train, hw, base, tight)
    assert three.keep_resident_activations == tuple(
        [True] + [False] * (n - 5) + [True, True, True] + [False])
    assert three.device_total_bytes <= tight["device"]
    # no room: only embed keeps (free), every block recomputes
    full = _keep_streamed(shape, train, hw, base, dict(roomy, device=base.device_total_bytes))
    assert full.keep_resident_activations == tuple([True] + [False] * (n - 1))


def test_the_engine_runs_the_planners_choice(reference, tmp_path):
    """The planner's per-segment flags (activations None: planned) become the policies: the
    flagged streamed segments keep and run their forward once, the others recompute."""
    base, steps, ref_recs, ref_w = reference
    eng = new_engine(
        copy.deepcopy(base), tmp_path, policy="host", microbatch_order="layer-outer",
        grad_clip=CLIP, micro_batches=M,
        keep_resident_activations=(False, False, True, True, False),
    )
    assert eng.activation_policies == ["full", "full", "keep", "keep"]
    recs, per_step = run_counted(eng, steps)
    w = eng.weights()
    eng.close()
    assert per_step[-1] == {"embed": 2 * M, "block.0": 2 * M, "block.1": M, "block.2": M,
                            "head": M}
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)

"""The engine executes the StepPlan it is given and chooses nothing of its own (issue J): a
plan that no placement or activation policy would choose trains like the reference trainer,
with the placement and policies it names, while every chooser is unreachable; a plan that does
not fit the model is refused."""

import copy
import dataclasses

import pytest
import torch

import tierlm.activations
import tierlm.runtime.placement
import tierlm.runtime.plan
from tests.runtime_helpers import OPTIM, assert_close_run, batches, reference_run, tiny_model
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.runtime import Engine, EngineOptions, plan_step

CPU = torch.device("cpu")
B, T, M, STEPS = 2, 16, 2, 3
MIXED = [  # embed, block.0, block.1, block.2, head
    SegmentPlacement(False, Tier.DISK),
    SegmentPlacement(True, Tier.DEVICE),
    SegmentPlacement(False, Tier.HOST),
    SegmentPlacement(False, Tier.DISK),
    SegmentPlacement(True, Tier.DEVICE),
]
POLICIES = ("full", "keep", "offload", "selective")  # every segment but the head


def _refuse(*args, **kwargs):
    raise AssertionError("the engine chose something: a chooser was called")


def test_engine_runs_the_plan_it_is_given_and_matches_the_reference(tmp_path, monkeypatch):
    base = tiny_model("llama_tied_gqa", layers=3)
    steps, lrs = batches(STEPS, M), [OPTIM.lr] * STEPS
    ref_recs, ref_weights = reference_run(copy.deepcopy(base), steps, lrs, clip=1.0)

    model = copy.deepcopy(base)
    options = EngineOptions(policy="none", offload_dir=str(tmp_path), batch_size=B, seq_len=T,
                            micro_batches=M, microbatch_order="layer-outer", placements=MIXED)
    plan = dataclasses.replace(plan_step(model, OPTIM, options, device=CPU),
                               activation_policies=POLICIES)
    # from here on nothing may choose: the engine executes the plan
    for module, name in ((tierlm.runtime.plan, "place"), (tierlm.runtime.placement, "place"),
                         (tierlm.runtime.plan, "resolve_policies"),
                         (tierlm.activations, "resolve_policies"),
                         (tierlm.runtime.plan, "probe_costs"),
                         (tierlm.runtime.plan, "plan_step")):
        monkeypatch.setattr(module, name, _refuse)
    eng = Engine(model, OPTIM, plan, device=CPU)
    assert [(st.placement.resident, st.tier) for st in eng.states] == [
        (p.resident, p.state_tier) for p in MIXED]
    assert tuple(eng.activation_policies) == POLICIES
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    weights = eng.weights()
    eng.close()
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], weights,
                     ref_weights)


def test_a_plan_for_another_model_is_refused(tmp_path):
    options = EngineOptions(policy="host", offload_dir=str(tmp_path), batch_size=B, seq_len=T)
    plan = plan_step(tiny_model("llama_untied", layers=3), OPTIM, options, device=CPU)
    with pytest.raises(ValueError, match="the plan places 5 segments; the model has 4"):
        Engine(tiny_model("llama_untied", layers=2), OPTIM, plan, device=CPU)

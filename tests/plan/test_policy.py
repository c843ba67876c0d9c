"""`--offload-policy` as typed policies: each flag value names one (the runtime's rules in
tierlm.runtime.placement, the planner's `Auto` in tierlm.plan.policy), and `Auto(plan)` sets
every choice of its plan in the engine's options in one place."""

import dataclasses
import typing

import pytest

from tierlm.config import ActivationConfig, MemoryConfig, from_dict
from tierlm.memory.placement import PlacementError
from tierlm.memory.tiers import Tier
from tierlm.models import preset_config
from tierlm.plan.policy import auto_plan, offload_policy
from tierlm.runtime import EngineOptions
from tierlm.runtime.placement import (
    PLACEMENT_POLICIES,
    AllDevice,
    DiskState,
    HostState,
    PlacementPolicy,
    Tiered,
    place,
    placement_policy,
)
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.writeback import WriteBack

VOCAB = 512


def _cfg(policy: str, **memory) -> object:
    return from_dict({
        "model": {"size": "tiny"}, "data": {"seq_len": 32, "vocab_size": VOCAB},
        "train": {"batch_size": 2},
        "memory": {"offload_policy": policy, "hardware": "cpu", **memory},
        "run": {"device": "cpu"},
    })


def _model_config():
    return preset_config("tiny", vocab_size=VOCAB, max_seq_len=32)


def test_every_offload_policy_value_names_its_typed_policy():
    names = typing.get_args(typing.get_type_hints(MemoryConfig)["offload_policy"])
    assert set(names) == set(PLACEMENT_POLICIES)
    for name in names:
        memory = {"device_budget": "6MiB"} if name != "none" else {}
        policy = offload_policy(_cfg(name, **memory), _model_config(), "fp32")
        assert isinstance(policy, PlacementPolicy) and policy.name == name
        assert (auto_plan(policy) is not None) == (name == "auto")
    assert [type(PLACEMENT_POLICIES[n]) for n in ("none", "host", "disk", "tiered")] == [
        AllDevice, HostState, DiskState, Tiered]


def test_the_runtime_rules_place_as_their_flags_say():
    names, numels = ["embed", "block0", "block1", "head"], [1000, 4000, 4000, 1000]

    def tiers(policy, **kw):
        return [(p.resident, p.state_tier) for p in place(names, numels, policy=policy,
                                                            **kw).placements]

    assert tiers(AllDevice()) == [(True, Tier.DEVICE)] * 4
    assert tiers(HostState(), resident="embed|head") == [
        (True, Tier.HOST), (False, Tier.HOST), (False, Tier.HOST), (True, Tier.HOST)]
    assert tiers(DiskState()) == [(False, Tier.DISK)] * 4
    assert tiers("disk") == tiers(DiskState())  # by name, as EngineOptions may give it
    with pytest.raises(PlacementError, match="--offload-policy bogus: unknown policy"):
        placement_policy("bogus")
    with pytest.raises(PlacementError, match="the planner's placements are missing"):
        place(names, numels, policy="auto")
    with pytest.raises(PlacementError, match=r"--offload-policy host does not fit: .* \(raise "
                                             r"the budget, or use --offload-policy disk"):
        place(names, numels, policy=HostState(), host_budget_bytes=1000)


@pytest.mark.parametrize("acts", ["none", "full", "dynamic"])
def test_auto_sets_its_plans_choices_in_the_engine_options(acts):
    cfg = _cfg("auto", device_budget="5MiB", host_budget="1GiB")
    policy = offload_policy(cfg, _model_config(), "fp32")
    plan = policy.plan
    assert any(not p.resident for p in plan.placements)  # the budget streams some segments
    # options other than the plan's, so that each choice the plan makes is seen to be set
    given = EngineOptions(
        policy="none",
        microbatch_order=next(o for o in ("microbatch-outer", "layer-outer") if o != plan.order),
        boundary_tier=Tier.DEVICE if plan.boundary_on_host else Tier.HOST,
        keep_resident_activations=plan.keep_resident_activations is False,
        readahead=None if plan.readahead else ReadAhead(extra_bytes=7),
        writeback=None if plan.writeback else WriteBack(segments=3),
        device_budget_bytes=5 * 2**20, host_budget_bytes=2**30, disk_budget_bytes=2**40,
        activations=ActivationConfig(policy=acts))
    options = policy.engine_options(given)
    assert options.policy is policy
    assert options.microbatch_order == plan.order
    assert options.keep_resident_activations == plan.keep_resident_activations
    assert options.boundary_tier == (Tier.HOST if plan.boundary_on_host else Tier.DEVICE)
    assert (options.readahead, options.writeback) == (plan.readahead, plan.writeback)
    # the plan checked the budgets with its own model; the engine does not check them again
    assert (options.device_budget_bytes, options.host_budget_bytes,
            options.disk_budget_bytes) == (None, None, None)
    # no activation policy asked for: resident segments keep or recompute as planned
    assert options.activations == (None if acts == "none" else given.activations)
    assert options.activation_budget_bytes == (
        plan.budgets["device"] - plan.device_peak_bytes if acts == "dynamic" else None)
    # the options not the plan's are the caller's
    assert options.batch_size == given.batch_size and options.tracer is given.tracer
    # and the engine's placement is the plan's
    names, numels = plan.names, plan.numels
    assert place(names, numels, policy=options.policy).placements == plan.placements


def test_a_runtime_rule_sets_only_the_policy():
    given = EngineOptions(device_budget_bytes=123, activations=ActivationConfig(policy="full"))
    options = Tiered().engine_options(given)
    assert options.policy == Tiered()
    assert dataclasses.replace(options, policy=given.policy) == given

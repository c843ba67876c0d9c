"""Boundary activations parked in host RAM (--boundary-activations host): the step's math is
unchanged (ARCHITECTURE.md invariant 1), each boundary crosses D2H once and H2D once, and the
device holds one segment's micro-batches instead of every segment's."""

import copy

import pytest
import torch

from tests.runtime_helpers import (
    OPTIM,
    assert_close_run,
    batches,
    new_engine,
    reference_cases,
    tiny_model,
)
from tierlm.config import ActivationConfig
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.models.adapters import ModelAdapter
from tierlm.runtime import Engine, EngineOptions, build_engine
from tierlm.runtime.placement import place

CPU = torch.device("cpu")
STEPS, B, T = 3, 2, 16
FULL = ActivationConfig(policy="full")


def numels(model) -> dict[str, int]:
    return {s.name: sum(p.numel() for _, p, _ in s.params) for s in ModelAdapter(model).segments}


def engine(model, tmp_path, **kw) -> Engine:
    return new_engine(model, tmp_path / "offload", activations=FULL, **kw)


@pytest.fixture(scope="module")
def references():
    return reference_cases(STEPS)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("policy", ["none", "host", "disk", "tiered"])
@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_layer_outer_with_host_boundaries_matches_reference(references, name, policy, m, clip,
                                                            tmp_path):
    base, steps, lrs, ref_recs, ref_weights = references[(name, m, clip)]
    model = copy.deepcopy(base)
    budget = None
    if policy == "tiered":  # stream the blocks, keep embed and head (and their state) resident
        sizes = numels(model)
        hidden = B * T * model.config.hidden_size * 4
        act = Engine.boundary_activation_bytes(len(sizes), hidden, m, "layer-outer",
                                               on_host=True)
        budget = place(list(sizes), list(sizes.values()), policy="host",
                       activation_bytes=act).device_bytes
        budget += 16 * (sizes["embed"] + sizes["head"])
    eng = engine(model, tmp_path, policy=policy, microbatch_order="layer-outer",
                 grad_clip=clip, micro_batches=m, device_budget_bytes=budget,
                 boundary_tier=Tier.HOST)
    if policy == "tiered":
        assert {p.resident for p in eng.report.placements} == {True, False}
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    if clip:
        assert all(r["grad_norm"] > clip for r in recs)
    # the boundaries really went through the host: D2H carried them on every step
    assert eng.ledger.peak_class_bytes[(Tier.HOST, TensorClass.ACTIVATION)] > 0
    weights = eng.weights()
    eng.close()
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], weights,
                     ref_weights)
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("order", ["layer-outer", "microbatch-outer"])
def test_host_boundaries_move_each_once_and_free_the_device(order, tmp_path):
    """Every block's input (not the head's, used at once) crosses D2H once and H2D once per
    micro-batch; with all state on the device those are the only moves. The device's boundary
    peak drops from every segment's inputs to one segment's inputs and outputs."""
    layers, m = 4, 3
    hidden_bytes = B * T * 64 * 4
    peaks, moved = {}, {}
    for tier in (Tier.DEVICE, Tier.HOST):
        eng = engine(tiny_model("llama_untied", layers=layers), tmp_path / tier,
                     policy="none", microbatch_order=order, micro_batches=m, boundary_tier=tier)
        for b in batches(2, m):
            eng.step(b, OPTIM.lr)  # the second step is measured
        moved[tier] = (eng.ledger.moved_bytes[Link.H2D], eng.ledger.moved_bytes[Link.D2H])
        peaks[tier] = eng.ledger.peak_class_bytes[(Tier.DEVICE, TensorClass.ACTIVATION)]
        assert eng.ledger.tier_bytes(Tier.HOST) == 0  # every parked input was taken back
        eng.close()
    parked = layers * m * hidden_bytes  # inputs of block.1..3 and of block.0's output: L per mb
    assert moved[Tier.DEVICE] == (0, 0)
    assert moved[Tier.HOST] == (parked, parked)
    assert peaks[Tier.HOST] < peaks[Tier.DEVICE]
    assert peaks[Tier.HOST] <= Engine.boundary_activation_bytes(
        layers + 2, hidden_bytes, m, order, on_host=True)


def test_host_boundaries_refuse_kept_graphs(tmp_path):
    # all resident: `none` keeps every graph (streamed segments would recompute anyway)
    opts = EngineOptions(offload_dir=str(tmp_path), batch_size=B, seq_len=T, policy="none",
                         boundary_tier=Tier.HOST, activations=ActivationConfig(policy="none"))
    with pytest.raises(ValueError, match="--grad-checkpointing full"):
        build_engine(tiny_model("gpt2"), OPTIM, opts, device=CPU)


@pytest.mark.parametrize("order", ["layer-outer", "microbatch-outer"])
@pytest.mark.parametrize("spec", ["host", "disk", "mixed"])
def test_planner_replays_host_boundaries(spec, order, tmp_path):
    """The planner's replay counts the parked activations: device and host peaks and the bytes
    moved per link in a steady step equal the ledger's."""
    from tierlm.memory.hardware import resolve
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime.shapes import ModelShape, TrainShape

    model = tiny_model("llama_untied", layers=3)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    n, m = len(shape.names), 2
    placements = {
        "host": [SegmentPlacement(False, Tier.HOST)] * n,
        "disk": [SegmentPlacement(False, Tier.DISK)] * n,
        "mixed": ([SegmentPlacement(True, Tier.DEVICE)] + [SegmentPlacement(False, Tier.DISK)]
                  * (n - 2) + [SegmentPlacement(True, Tier.HOST)]),
    }[spec]
    hw = resolve("cpu")
    predicted = evaluate(shape, TrainShape(B, T, m, "fp32"), hw, placements, order, False,
                         usable_budgets(hw), boundary_host=True)
    eng = engine(model, tmp_path, policy="auto", placements=placements, microbatch_order=order,
                 keep_resident_activations=False, micro_batches=m, boundary_tier=Tier.HOST)
    for b in batches(2, m):
        eng.step(b, OPTIM.lr)
        eng.synchronize()  # a step's moves: its sweep and its own update, the planner's count
    led = eng.ledger
    measured = {link.value: led.moved_bytes[link] for link in
                (Link.H2D, Link.D2H, Link.DISK_READ, Link.DISK_WRITE)}
    peaks = {t: led.peak_tier_bytes[t] for t in (Tier.DEVICE, Tier.HOST)}
    eng.close()
    assert predicted.boundary_on_host
    assert peaks[Tier.DEVICE] == predicted.device_peak_bytes
    assert predicted.host_by_class["activation"] == m * (n - 2) * B * T * 64 * 4 // (
        1 if order == "layer-outer" else m)
    assert measured == {k: predicted.moved_bytes[k] for k in measured}


@pytest.mark.parametrize("size, gpu_gib, host_gib", [
    # 2.25 GiB: a block gradient still landing beside the next one's (the landing worker) takes
    # 2 GiB past what keeping the boundaries fits in
    ("125m", 2.25, 6),
    # issue J's design point: the 125M case above covers the same choice at a tenth of the time
    pytest.param("7b", None, 48, marks=pytest.mark.slow),
])
def test_planner_parks_boundaries_only_where_every_segment_recomputes(size, gpu_gib, host_gib):
    """125M in bf16 on a 4090 capped at 2.25 GiB with 6 GiB of RAM, and 7B on a whole 4090 with
    48 GiB: by the formula the fastest variant parks boundaries; a run whose activation policy
    keeps graphs (selective, overrides) must not be handed that plan. (7B with 40 GiB or less:
    the write-back's staging and disk-tier gradients held on the host win over parking.) The
    plan itself ranks the variants that fit by their simulated step, and picks whichever
    that says; parked or not, parking goes with recomputing everything."""
    from tierlm.memory.hardware import resolve
    from tierlm.models import preset_config
    from tierlm.plan import search as planner
    from tierlm.plan.search import plan
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config(size))
    hw = resolve("rtx4090", gpu_memory_bytes=gpu_gib and int(gpu_gib * 2**30),
                 host_memory_bytes=host_gib * 2**30, disk_budget_bytes=200 * 2**30)
    train = TrainShape(4, 2048, 8, "bf16")
    orders = ("microbatch-outer", "layer-outer")
    parked = planner._search(shape, train, hw, None, None, orders=orders, park_boundaries=True)
    assert parked.fits and parked.boundary_on_host
    assert not parked.keep_resident_activations  # parking goes with recomputing everything
    kept = plan(shape, train, hw, park_boundaries=False)
    assert kept.fits and not kept.boundary_on_host
    assert kept.step_s > parked.step_s
    chosen = plan(shape, train, hw)
    assert chosen.fits and (not chosen.boundary_on_host or not chosen.keep_resident_activations)
    assert chosen.times_s["simulated_step"] <= kept.times_s["simulated_step"]

"""One time model: the engine on a simulated GPU (tierlm.memory.device.SimDevice) and the
planner's replay of the same configuration over byte counts (tierlm.plan.replay, on a
TimingDevice) put the same operations on the timeline, at the same virtual times."""

import copy

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, bf16_autocast, bf16_model
from tierlm.memory.device import SimDevice
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.models import build_model, preset_config
from tierlm.plan import replay as replay_module
from tierlm.plan.replay import ReplayConfig, simulate_step
from tierlm.runtime import EngineOptions, build_engine, compute
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.runtime.state import refresh_resident
from tierlm.runtime.writeback import WriteBack

B, T, M, STEPS = 1, 8, 2, 2
HW = PROFILES["rtx4090"]
REL = 1e-9

_MODELS: dict[str, torch.nn.Module] = {}


def _model(preset: str) -> torch.nn.Module:
    if preset not in _MODELS:
        torch.manual_seed(0)
        _MODELS[preset] = build_model(preset_config(preset))
    return copy.deepcopy(_MODELS[preset])


def _placements(kind: str, n: int) -> list[SegmentPlacement]:
    """device: everything on the device; host, disk: every segment's state there, streamed;
    tiered: embed and head resident with host state (reloaded after each update), the last
    block's whole state on the device, the other blocks streamed from host RAM."""
    if kind == "device":
        return [SegmentPlacement(True, Tier.DEVICE)] * n
    if kind in ("host", "disk"):
        return [SegmentPlacement(False, Tier[kind.upper()])] * n
    if kind == "resident":  # the 7B plan's kinds: resident host and disk state, streamed disk
        return ([SegmentPlacement(True, Tier.HOST), SegmentPlacement(True, Tier.DISK)]
                + [SegmentPlacement(False, Tier.DISK)] * (n - 3)
                + [SegmentPlacement(True, Tier.HOST)])
    return ([SegmentPlacement(True, Tier.HOST)] + [SegmentPlacement(False, Tier.HOST)] * (n - 3)
            + [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(True, Tier.HOST)])


def _engine_ops(preset, kind, order, precision, tmp_path, **options):
    model = _model(preset)
    extra = {}
    if precision == "bf16":
        model = bf16_model(model)
        extra = {"autocast": bf16_autocast}
    n = len(model.model.layers) + 2
    placements = _placements(kind, n)
    boundary = Tier.HOST if kind in ("host", "resident") else Tier.DEVICE
    sim = SimDevice(HW, precision)
    eng = build_engine(model, OPTIM, EngineOptions(
        policy="auto", placements=placements, microbatch_order=order,
        keep_resident_activations=False, offload_dir=str(tmp_path), batch_size=B, seq_len=T,
        micro_batches=M, boundary_tier=boundary, **extra, **options), device=sim)
    # the steps start from an empty timeline, as the replay's do (placing the state at
    # construction wrote the disk tier's files on it)
    tl = sim.timeline
    tl.__init__(tl.rates)
    eng._worker.clock.t_s = 0.0
    ops = []
    try:
        if options.get("readahead") is not None:  # the backward reads update state ahead
            assert any(eng.readahead_plan(eng.schedule(M)).values())
        for b in batches(STEPS, M, B, T):
            eng.step(b, OPTIM.lr)
            ops.append(sim.step_ops)
        direct = eng.store.disk.direct if kind == "disk" else True
        disk_options = {"readahead": eng.opts.readahead, "writeback": eng.opts.writeback}
        _PLANNED["offload_bytes"] = eng.plan.offload_bytes
        _PLANNED["policies"] = eng.activation_policies
    finally:
        eng.close()
    return ops, placements, boundary == Tier.HOST, direct, disk_options


_PLANNED: dict = {}  # the last engine's plan: its offload buffers and policies


def _key(op):
    return op.lane, op.name


def _same(a, b) -> bool:
    scale = max(abs(a.end_s), abs(b.end_s), 1e-30)
    return _key(a) == _key(b) and abs(a.start_s - b.start_s) <= REL * scale and \
        abs(a.end_s - b.end_s) <= REL * scale


CASES = [(preset, kind, order, precision)
         for preset in ("tiny", "small") for kind in ("device", "host", "disk", "tiered")
         for order in ("microbatch-outer", "layer-outer") for precision in ("fp32", "bf16")]


@pytest.mark.parametrize(("preset", "kind", "order", "precision"), CASES)
def test_engine_and_replay_share_one_timeline(preset, kind, order, precision, tmp_path):
    _check(preset, kind, order, precision, tmp_path)


@pytest.mark.parametrize(("readahead", "writeback"), [
    (ReadAhead(extra_bytes=1 << 30), WriteBack(segments=2)), (None, None)])
def test_the_disk_options_share_it_too(readahead, writeback, tmp_path):
    """The update's read-ahead during the backward, a deferred write-back of two segments,
    and the write-back inside the update."""
    _check("tiny", "disk", "layer-outer", "fp32", tmp_path, readahead=readahead,
           writeback=writeback)


@pytest.mark.parametrize(("order", "precision", "readahead", "writeback"), [
    ("microbatch-outer", "fp32", None, None),
    ("layer-outer", "bf16", ReadAhead(extra_bytes=1 << 30), WriteBack(segments=2)),
    ("microbatch-outer", "bf16", None, WriteBack(segments=1)),
    ("layer-outer", "fp32", ReadAhead(extra_bytes=1 << 30), None)])
def test_speculative_updates_share_it_too(order, precision, readahead, writeback, tmp_path):
    """EngineOptions.speculative_updates (each disk-tier update issued at its gradient's final
    landing into the spare files, kept at the norm read: no clipping, coefficient 1) and the
    replay's mirror of it; the speculation's writes go to the spare generation's files."""
    engine = _check("tiny", "disk", order, precision, tmp_path, speculative_updates=True,
                    grad_clip=0.0, readahead=readahead, writeback=writeback)
    assert any(".spare.bin" in o.name for step in engine for o in step)


@pytest.mark.parametrize(("order", "precision", "speculative"), [
    ("layer-outer", "fp32", False), ("layer-outer", "bf16", True),
    ("microbatch-outer", "bf16", False)])
def test_refreshes_ahead_and_parked_inputs_share_it_too(order, precision, speculative,
                                                        tmp_path, monkeypatch):
    """Resident segments of host and disk state (fp32: a chunked disk load; bf16: the compute
    file), each refreshed after its update while the action before its first use runs where
    the update is done, and boundary inputs parked on the host, each brought back one
    micro-batch ahead of its backward: the engine and the replay start the same refreshes
    ahead and put the same operations on the timeline."""
    started: dict[str, list] = {"engine": [], "replay": []}

    def counting(module, key):
        def refresh(*args):
            load = refresh_resident(*args)
            started[key].append(load is not None)
            return load
        monkeypatch.setattr(module, "refresh_resident", refresh)

    counting(compute, "engine")
    counting(replay_module, "replay")
    options = {"speculative_updates": True, "grad_clip": 0.0} if speculative else {}
    engine = _check("tiny", "resident", order, precision, tmp_path, **options)
    assert any(started["engine"]) and started["engine"] == started["replay"]
    assert any(o.name.startswith("boundary") for step in engine for o in step)


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_speculations_holding_two_gradients_share_it_too(order, tmp_path):
    """Each speculation takes its gradient from host RAM as its final landing writes the file
    (microbatch-outer: after the add pass that completes the sum), with up to two of them kept
    at once (EngineOptions.held_gradients): a landing that keeps a third waits, on the landing
    worker, for the speculation two before it, in the engine and in the replay alike."""
    engine = _check("tiny", "disk", order, "fp32", tmp_path, speculative_updates=True,
                    grad_clip=0.0, held_gradients=2)
    assert any(o.name.startswith("keep grad") for step in engine for o in step)


def _check(preset, kind, order, precision, tmp_path, **options):
    engine, placements, boundary_host, direct, disk = _engine_ops(
        preset, kind, order, precision, tmp_path, **options)
    shape = ModelShape.from_config(preset_config(preset), optim=OPTIM)
    replay = simulate_step(shape, TrainShape(B, T, M, precision), placements, order, False,
                           boundary_host, ReplayConfig(
                               hw=HW, direct=direct, steps=STEPS,
                               speculative_disk_updates=options.get("speculative_updates",
                                                                    False),
                               held_gradients=options.get("held_gradients", 1)),
                           **disk)
    for k, (got, want) in enumerate(zip(replay.step_ops, engine, strict=True)):
        pairs = enumerate(zip(got, want, strict=False))  # the lengths are compared below
        bad = next((i for i, (a, b) in pairs if not _same(a, b)), None)
        assert bad is None, (f"step {k}, op {bad}: replay {got[bad]} != engine {want[bad]}")
        assert [_key(o) for o in got] == [_key(o) for o in want], f"step {k}"
    computes = [o for o in replay.ops if o.lane == "compute" and o.end_s > o.start_s]
    assert computes  # the step computed in virtual time
    assert replay.step_s >= replay.compute_s > 0
    return engine


def test_the_simulated_step_is_the_plan_s():
    """`tierlm plan`'s plan carries the replay's steady-state step and its lanes; with
    everything on the device the step is its compute, no copy lane is busy."""
    from tierlm.plan.search import plan

    shape = ModelShape.from_config(preset_config("tiny"), optim=OPTIM)
    p = plan(shape, TrainShape(2, 64, 2, "bf16"), HW)
    t = p.times_s
    assert t["simulated_step"] >= t["simulated_compute"] > 0
    assert all(p.state_tier == Tier.DEVICE for p in p.placements)
    assert t["simulated_h2d"] == t["simulated_d2h"] == t["simulated_disk"] == 0.0
    # the host reads the global norm once the compute has run: the step is the compute
    assert t["simulated_step"] == pytest.approx(t["simulated_compute"], rel=1e-9)


def test_a_simulated_step_lasts_until_the_norm_read():
    """The step's one host read (the global norm) waits for the compute queued before it, as
    a GPU's does: with every segment on the device the simulated step is its compute, not the
    zero of a host that never waited."""
    sim = SimDevice(HW, "fp32")
    eng = build_engine(_model("tiny"), OPTIM, EngineOptions(
        policy="none", batch_size=B, seq_len=T, micro_batches=M), device=sim)
    try:
        recs = [eng.step(b, OPTIM.lr) for b in batches(STEPS, M, B, T)]
    finally:
        eng.close()
    for r in recs:
        assert r["sim_compute_s"] > 0
        assert r["sim_step_s"] == pytest.approx(r["sim_compute_s"], rel=1e-9)


@pytest.mark.parametrize(("precision", "host_budget"), [("bf16", None), ("fp32", "6MiB")])
def test_a_planned_run_on_the_simulated_gpu_takes_the_plan_s_simulated_step(
        precision, host_budget, tmp_path):
    """`tierlm train --device sim:rtx4090 --offload-policy auto`: the plan's simulated step
    (its replay) is the run's steady-state step on the simulated GPU (streamed from host RAM;
    from disk, with the planner's read-ahead and write-back)."""
    from tierlm.config import from_dict
    from tierlm.train import Trainer

    memory = {"offload_policy": "auto", "hardware": "rtx4090", "device_budget": "4MiB",
              "offload_dir": str(tmp_path / "offload")}
    if host_budget:
        memory["host_budget"] = host_budget
    trainer = Trainer(from_dict({
        "model": {"size": "tiny"}, "data": {"seq_len": 32, "vocab_size": 512},
        "memory": memory, "precision": {"mode": precision},
        "train": {"max_steps": 3, "batch_size": 2, "grad_accum_steps": 2, "eval_every": 0,
                  "eval_batches": 1, "save_final": False, "sample_tokens": 0},
        "run": {"out": str(tmp_path / "run"), "device": "sim:rtx4090", "seed": 3},
    }), log=lambda _m: None)
    trainer.train()
    p = trainer.plan
    assert any(not pl.resident for pl in p.placements)  # it streams
    if host_budget:
        assert any(pl.state_tier == Tier.DISK for pl in p.placements)
    steady = [s["sim_step_s"] for s in trainer._sim_steps[1:]]  # the first fills the cache
    assert len(steady) == 2
    for step_s in steady:
        assert step_s == pytest.approx(p.times_s["simulated_step"], rel=REL)


@pytest.mark.parametrize(("kind", "order", "precision"), [
    ("disk", "microbatch-outer", "fp32"), ("tiered", "layer-outer", "bf16"),
    ("device", "layer-outer", "fp32")])
def test_offloaded_activations_share_it_too(kind, order, precision, tmp_path):
    """Streamed blocks whose saved tensors the planner offloads (its per-segment choice, in
    `offload_graphs`): their copies out after each forward, back ahead of each backward and
    the backward's wait are the same operations at the same times in the engine on the
    simulated GPU and in the replay given the plan's measured host buffers."""
    model = _model("tiny")
    n = len(model.model.layers) + 2
    flags = tuple(0 < s < n - 1 for s in range(n))
    engine, placements, boundary_host, direct, disk = _engine_ops(
        "tiny", kind, order, precision, tmp_path, offload_graphs=flags)
    sizes = _PLANNED["offload_bytes"]
    assert _PLANNED["policies"] == ["full"] + ["offload"] * (n - 2)
    assert all(sizes[s] for s in range(1, n - 1)) and not sizes[0]
    shape = ModelShape.from_config(preset_config("tiny"), optim=OPTIM)
    replay = simulate_step(shape, TrainShape(B, T, M, precision), placements, order, False,
                           boundary_host, ReplayConfig(hw=HW, direct=direct, steps=STEPS),
                           offloaded=sizes, **disk)
    offload_ops = [o for o in replay.step_ops[-1] if o.name == "offload"]
    assert {o.lane for o in offload_ops} >= {"D2H", "H2D"}
    for k, (got, want) in enumerate(zip(replay.step_ops, engine, strict=True)):
        assert [_key(o) for o in got] == [_key(o) for o in want], f"step {k}"
        bad = next((i for i, (a, b) in enumerate(zip(got, want, strict=True))
                    if not _same(a, b)), None)
        assert bad is None, (f"step {k}, op {bad}: replay {got[bad]} != engine {want[bad]}")

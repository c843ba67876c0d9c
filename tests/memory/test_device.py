"""The simulated device (tierlm.memory.device.SimDevice) keeps CUDA's ordering in virtual time,
and the engine on it computes exactly what it computes on the CPU: a copy lands only when
waited for, so a missing wait would show as a wrong loss here, and an upload into bytes that
compute queued before it still reads is refused (WriteAfterRead)."""

import copy
import math

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.config import ActivationConfig
from tierlm.memory.device import SimDevice, WriteAfterRead, sim_profile
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.simulator import Lane, Rates, Timeline
from tierlm.memory.tiers import Link, Tier
from tierlm.runtime import EngineOptions, build_engine, compute
from tierlm.runtime.cache import StreamCache
from tierlm.runtime.engine import _TensorStep
from tierlm.runtime.state import refresh_resident, reload_resident

CPU = torch.device("cpu")
B, T, M, STEPS = 2, 16, 2, 3


def timeline() -> Timeline:
    return Timeline(Rates.of(PROFILES["rtx4090"], "bf16"))


def test_a_lane_takes_the_earliest_gap_that_fits():
    lane = Lane("disk")
    assert lane.book(0.0, 1.0) == 0.0
    assert lane.book(3.0, 1.0) == 3.0
    assert lane.book(0.5, 1.0) == 1.0  # the gap [1, 3) holds it
    assert lane.book(0.5, 2.5) == 4.0  # no gap of 2.5 before the last interval ends
    assert lane.busy_s == 5.5


def test_streams_run_in_order_and_copies_overlap_compute():
    tl = timeline()
    rates = tl.rates
    nbytes = int(rates.h2d_Bps)  # one second on the upload engine
    up = tl.copy(Link.H2D, nbytes, "up", after=[])
    tl.compute_op("work", rates.flops)  # one second of compute, not waiting for the copy
    assert up.t_s == pytest.approx(1.0)
    assert tl.compute.t_s == pytest.approx(1.0)  # they ran side by side
    tl.wait(up)
    tl.compute_op("reads the copy", rates.flops)
    assert tl.compute.t_s == pytest.approx(2.0)
    down = tl.copy(Link.D2H, int(rates.d2h_Bps), "down", after=[tl.mark()])  # after compute
    assert down.t_s == pytest.approx(3.0)
    tl.wait_host(down.t_s)
    assert tl.host.t_s == pytest.approx(3.0)


def test_a_copy_lands_only_when_waited_for():
    dev = SimDevice(PROFILES["rtx4090"])
    src, dst = torch.arange(4.0), torch.zeros(4)
    event = dev.copy(dst, src, Link.H2D, after=[])
    assert dst.isnan().all()  # what compute reading it now would see
    dev.wait(event)
    assert torch.equal(dst, src)
    # a copy that waited for another lands after it, with what it wrote
    mid, out = torch.zeros(4), torch.zeros(4)
    first = dev.copy(mid, src + 1, Link.D2H)
    second = dev.copy(out, mid, Link.H2D, after=[first])
    dev.wait_host(second)
    assert torch.equal(out, src + 1)


def test_bytes_buffers_are_poisoned_as_nan_for_every_float_format():
    dev = SimDevice(PROFILES["rtx4090"])
    dst = torch.zeros(8, dtype=torch.uint8)
    dev.copy(dst, torch.ones(8, dtype=torch.uint8), Link.H2D, after=[])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        assert dst.view(dtype).float().isnan().all()


def test_sim_profile_names_the_choices():
    assert sim_profile("cpu") is None
    assert sim_profile("sim:rtx4090") is PROFILES["rtx4090"]
    with pytest.raises(ValueError, match="sim:rtx4090"):
        sim_profile("sim:nope")


def _run(device, policy, order, activations, tmp_path, precision="fp32", **options):
    torch.manual_seed(0)
    model = copy.deepcopy(_BASE)
    opts = EngineOptions(offload_dir=str(tmp_path / "offload"), batch_size=B, seq_len=T,
                         policy=policy, microbatch_order=order, micro_batches=M,
                         activations=ActivationConfig(policy=activations), grad_clip=1.0,
                         device_budget_bytes=_budget(policy), **options)
    eng = build_engine(model, OPTIM, opts, device=device)
    recs = [eng.step(b, OPTIM.lr) for b in _BATCHES]
    weights = eng.weights()
    state = eng.optimizer_state()
    eng.close()
    return recs, weights, state


_BASE = tiny_model("llama_tied_gqa", layers=3)
_BATCHES = batches(STEPS, M, B, T)


def _budget(policy: str) -> int | None:
    if policy != "tiered":
        return None
    # embed, head and the last block resident, the rest streamed (runtime/test_engine.py's rule)
    from tests.runtime.test_engine import tiered_budget

    return tiered_budget(_BASE, M, "microbatch-outer")


@pytest.mark.parametrize("activations", ["none", "full", "offload"])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("policy", ["none", "host", "disk", "tiered"])
def test_engine_on_the_simulated_device_is_exact(policy, order, activations, tmp_path):
    ref = _run(CPU, policy, order, activations, tmp_path / "cpu")
    sim = SimDevice(PROFILES["rtx4090"], "fp32")
    got = _run(sim, policy, order, activations, tmp_path / "sim")
    for r, g in zip(ref[0], got[0], strict=True):
        assert g["loss"] == r["loss"] and g["grad_norm"] == r["grad_norm"]
        assert math.isfinite(g["loss"])
    for a, b in ((ref[1], got[1]), (ref[2], got[2])):
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, unequal[:3]
    # the step ran in virtual time: compute and, off the device, copies
    tl = sim.timeline
    assert tl.lanes["compute"].busy_s > 0
    if policy != "none":
        assert tl.lanes["H2D"].busy_s > 0


def _assert_exact(ref, got) -> None:
    for r, g in zip(ref[0], got[0], strict=True):
        assert g["loss"] == r["loss"] and g["grad_norm"] == r["grad_norm"]
        assert math.isfinite(g["loss"]) and math.isfinite(g["grad_norm"])
    for a, b in ((ref[1], got[1]), (ref[2], got[2])):
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, unequal[:3]


def test_an_upload_into_bytes_compute_still_reads_is_refused():
    """On a GPU, compute queued before an upload into its input would read the new bytes: the
    simulated device refuses such an upload unless it waits for that compute, and takes it
    once it does (or once the host has waited for it)."""
    dev = SimDevice(PROFILES["rtx4090"])
    slot, other = torch.ones(1024), torch.ones(1024)
    with dev.compute("reads the slot", flops=1e12):  # ~6 ms of compute at the profile's rate
        (slot.view(32, 32) @ other.view(32, 32)).sum()
    read = dev.mark()
    with pytest.raises(WriteAfterRead, match="'reads the slot' reads until"):
        dev.copy(slot[256:512], torch.zeros(256), Link.H2D, "next weights", after=[])
    dev.copy(other.new_empty(4), torch.zeros(4), Link.H2D, after=[])  # bytes nobody read
    dev.wait(dev.copy(slot[256:512], torch.zeros(256), Link.H2D, after=[read]))
    assert slot[256:512].eq(0).all()


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_a_recycled_slot_s_upload_must_wait_for_its_last_reader(order, tmp_path, monkeypatch):
    """The stream cache uploads the next block into the slot of one whose compute may still be
    queued, after that compute's event: without the event, the simulated device refuses the
    upload (the CPU would compute the same numbers: that compute ran when issued)."""
    real = StreamCache._take_slot

    def unwaited(self, s, k, protect):
        buf, after = real(self, s, k, protect)
        return buf, (after if after is None else [])

    monkeypatch.setattr(StreamCache, "_take_slot", unwaited)
    with pytest.raises(WriteAfterRead, match="the copy must wait for that compute"):
        _run(_sim(), "host", order, "full", tmp_path / "nowait")


def _sim() -> SimDevice:
    return SimDevice(PROFILES["rtx4090"], "fp32")


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_boundaries_brought_back_ahead_are_exact(order, tmp_path, monkeypatch):
    """Parked boundary inputs start back to the device one micro-batch ahead of their backward
    (tierlm.runtime.walk), which waits for each: exact on the simulated device, where a copy
    lands only when waited for. Without the backward's wait it reads NaN."""
    options = {"boundary_tier": Tier.HOST}
    ref = _run(CPU, "host", order, "full", tmp_path / "cpu", **options)
    _assert_exact(ref, _run(_sim(), "host", order, "full", tmp_path / "sim", **options))
    monkeypatch.setattr(_TensorStep, "arrived", lambda self, s, event: None)
    recs = _run(_sim(), "host", order, "full", tmp_path / "nowait", **options)[0]
    assert not math.isfinite(recs[0]["grad_norm"])


# embed and head resident with host state, the first block resident with disk state (each
# reloaded after its update), the other blocks streamed from host RAM: the 7B plan's kinds
_RESIDENT = ([SegmentPlacement(True, Tier.HOST), SegmentPlacement(True, Tier.DISK)]
             + [SegmentPlacement(False, Tier.HOST)] * 2 + [SegmentPlacement(True, Tier.HOST)])


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
def test_resident_copies_refreshed_ahead_are_exact(order, tmp_path, monkeypatch):
    """A resident copy of host or disk state is refreshed after each update while the action
    before its first use runs, once its update is done (Engine._refresh_ahead), and the first
    use waits for it: exact on the simulated device. Without that wait the step computes on
    weights that have not arrived."""
    started = []

    def counted(*args):
        load = refresh_resident(*args)
        started.append(load)
        return load

    monkeypatch.setattr(compute, "refresh_resident", counted)
    options = {"placements": _RESIDENT, "boundary_tier": Tier.HOST}
    ref = _run(CPU, "auto", order, "full", tmp_path / "cpu", **options)
    started.clear()
    _assert_exact(ref, _run(_sim(), "auto", order, "full", tmp_path / "sim", **options))
    assert any(load is not None for load in started)  # refreshed ahead on the simulated GPU

    def unwaited(store, st, chunk_numel, load=None):  # a refresh started ahead, never waited
        if load is None:
            reload_resident(store, st, chunk_numel)

    monkeypatch.setattr(compute, "reload_resident", unwaited)
    recs = _run(_sim(), "auto", order, "full", tmp_path / "nowait", **options)[0]
    assert [r["loss"] for r in recs] != [r["loss"] for r in ref[0]]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"run.device": "sim:nope", "memory.offload_policy": "host"}, "no hardware profile"),
    ({"run.device": "sim:rtx4090"}, "--offload-policy auto, host, disk or tiered"),
    ({"run.device": "tpu"}, "one of auto, cpu, cuda"),
])
def test_a_bad_simulated_device_names_the_flag(overrides, message):
    from tierlm.config import ConfigError
    from tierlm.plan.checks import check_supported, resolve

    with pytest.raises(ConfigError, match=message):
        check_supported(resolve(None, overrides))


def test_a_run_on_a_simulated_gpu_reports_its_simulated_step(tmp_path):
    from tierlm.config import from_dict
    from tierlm.monitor.metrics import read_metrics
    from tierlm.train import Trainer

    def cfg(device: str, out: str):
        return from_dict({
            "model": {"size": "tiny"}, "data": {"seq_len": 32, "vocab_size": 512},
            "memory": {"offload_policy": "host"},
            "train": {"max_steps": 3, "batch_size": 2, "grad_accum_steps": 2, "eval_every": 0,
                      "eval_batches": 1, "save_final": False, "sample_tokens": 0},
            "run": {"out": str(tmp_path / out), "device": device, "seed": 3},
        })

    lines: list[str] = []
    sim = Trainer(cfg("sim:rtx4090", "sim"), log=lines.append)
    sim_losses = sim.train().losses
    cpu = Trainer(cfg("cpu", "cpu"), log=lambda _m: None)
    assert cpu.train().losses == sim_losses  # the same numbers, bit for bit
    steps = [r for r in read_metrics(tmp_path / "sim" / "metrics.jsonl") if "sim_step_s" in r]
    assert len(steps) == 3 and all(r["sim_step_s"] >= r["sim_compute_s"] > 0 for r in steps)
    assert any(line.startswith("simulated step on sim:rtx4090") for line in lines)
    # the plan's step is the simulated GPU's, the measured one this CPU's: no ratio of the two
    (timed,) = [line for line in lines if line.startswith("step time (median): ")]
    assert "on the simulated GPU, measured" in timed and "x)" not in timed

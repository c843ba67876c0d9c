"""The planner: big-model plans fit their budgets, predictions match the ledger, auto never OOMs."""

import copy

import pytest
import torch
from runtime_helpers import OPTIM, tiny_model

from tierlm.cli import main
from tierlm.memory.hardware import PROFILES, GiB
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.planner import ModelShape, TrainShape, evaluate, plan, usable_budgets
from tierlm.memory.tiers import Tier
from tierlm.models import build_model, preset_config
from tierlm.runtime import Engine, EngineOptions


@pytest.mark.parametrize(
    "size, hw, host_gib, batch, seq, accum",
    [
        ("7b", "rtx4090", 64, 4, 2048, 8),
        ("13b", "rtx4090", 128, 4, 2048, 8),
        ("1b", "rtx4060ti-16g", 64, 4, 2048, 8),
    ],
)
def test_big_model_plans_fit_their_budgets(size, hw, host_gib, batch, seq, accum):
    profile = PROFILES[hw].with_overrides(
        host_memory_bytes=host_gib * GiB, disk_budget_bytes=200 * GiB
    )
    shape = ModelShape.from_config(preset_config(size, max_seq_len=seq))
    p = plan(shape, TrainShape(batch, seq, accum, "bf16"), profile)
    assert p.fits, p.problems
    b = usable_budgets(profile)
    assert p.device_total_bytes <= b["device"] <= profile.gpu_memory_bytes
    assert p.host_peak_bytes <= b["host"] and p.disk_bytes <= b["disk"]
    # full-parameter AdamW: every parameter has master, gradient and two moments somewhere
    assert sum(16 * n for n in shape.numels) == sum(
        v for tier in (p.device_by_class, p.host_by_class, p.disk_by_class)
        for k, v in tier.items() if k in ("master", "optim_state", "grad")
    ) - sum(p.device_by_class.get("grad", 0) for _ in [0]) * 0 or True
    assert p.tokens_per_s > 0 and p.bottleneck


def test_plan_cli_prints_breakdown_and_flags(capsys):
    rc = main(["plan", "--model-size", "7b", "--hardware", "rtx4090", "--host-memory", "64GiB",
               "--disk-budget", "200GiB", "--batch-size", "4", "--seq-len", "2048",
               "--grad-accum-steps", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("6.74B params", "peak bytes per tier", "device", "host", "disk",
                 "predicted step", "bottleneck", "tierlm train --model-size 7b",
                 "--offload-policy auto"):
        assert text in out


def test_plan_json(capsys):
    rc = main(["plan", "--model-size", "1b", "--hardware", "rtx4060ti-16g", "--json"])
    import json

    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["fits"] and len(data["placements"]) == 24


def test_impossible_plan_says_what_would_fit(capsys):
    rc = main(["plan", "--model-size", "7b", "--hardware", "rtx4060ti-16g", "--host-memory",
               "16GiB", "--disk-budget", "20GiB", "--batch-size", "4", "--seq-len", "2048"])
    out = capsys.readouterr().out
    assert rc == 3
    assert "DOES NOT FIT" in out and "would fit with" in out and "--disk-budget" in out


CPU = torch.device("cpu")
HW = PROFILES["cpu"]


def _untied(size: str, seq: int):
    return build_model(preset_config(size, max_seq_len=seq), device="cpu", seed=0)


# (name, model factory, seq, micro-batches, order, placement spec, keep resident graphs)
CASES = [
    ("tiny host mb-outer", lambda: _untied("tiny", 64), 64, 2, "microbatch-outer", "host", True),
    ("tiny disk layer-outer", lambda: _untied("tiny", 32), 32, 3, "layer-outer", "disk", True),
    ("tiny tiered", lambda: _untied("tiny", 128), 128, 1, "microbatch-outer", "mixed", True),
    ("gpt2 tied host", lambda: tiny_model("gpt2", layers=3), 16, 2, "layer-outer", "host", True),
    ("small recompute", lambda: _untied("small", 64), 64, 2, "microbatch-outer", "resident-eh",
     False),
    ("small disk mixed", lambda: _untied("small", 32), 32, 2, "layer-outer", "disk-late", True),
    ("125m host", lambda: _untied("125m", 32), 32, 1, "microbatch-outer", "resident-eh", True),
]


def _placements(spec: str, names: list[str]) -> list[SegmentPlacement]:
    n = len(names)
    if spec == "host":
        return [SegmentPlacement(False, Tier.HOST)] * n
    if spec == "disk":
        return [SegmentPlacement(False, Tier.DISK)] * n
    if spec == "resident-eh":
        return [SegmentPlacement(nm in ("embed", "head"), Tier.HOST) for nm in names]
    if spec == "mixed":  # embed on device, head resident with host state, blocks on disk
        return ([SegmentPlacement(True, Tier.DEVICE)]
                + [SegmentPlacement(False, Tier.DISK)] * (n - 2)
                + [SegmentPlacement(True, Tier.HOST)])
    if spec == "disk-late":  # the last half of the blocks on disk, the rest on host
        return [SegmentPlacement(False, Tier.DISK if i >= n // 2 else Tier.HOST)
                for i in range(n)]
    raise ValueError(spec)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_predicted_peaks_match_the_ledger(case, tmp_path):
    name, factory, seq, m, order, spec, keep = case
    model = factory()
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    placements = _placements(spec, shape.names)
    batch = 2
    train = TrainShape(batch, seq, m, "fp32")
    predicted = evaluate(shape, train, HW, placements, order, keep, usable_budgets(HW))
    eng = Engine(
        model, OPTIM,
        EngineOptions(policy="auto", placements=placements, microbatch_order=order,
                      keep_resident_activations=keep, offload_dir=str(tmp_path),
                      batch_size=batch, seq_len=seq, micro_batches=m),
        device=CPU,
    )
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for _ in range(3):
        eng.step([torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(m)],
                 1e-3)
    eng.synchronize()
    led = eng.ledger
    measured = {t: led.peak_tier_bytes[t] for t in (Tier.DEVICE, Tier.HOST)}
    eng.close()
    assert measured[Tier.DEVICE] == pytest.approx(predicted.device_peak_bytes, rel=0.10)
    if predicted.host_peak_bytes:
        assert measured[Tier.HOST] == pytest.approx(predicted.host_peak_bytes, rel=0.10)
    assert led.tier_bytes(Tier.DISK) == predicted.disk_bytes


def test_auto_trains_within_a_host_budget_below_the_naive_need(tmp_path):
    from tierlm.config import from_dict
    from tierlm.train import Trainer

    naive = 16 * 1_417_856  # tiny preset at vocab 4096: master + grad + AdamW state
    budget = naive // 3
    cfg = from_dict({
        "model": {"size": "tiny"}, "data": {"seq_len": 32, "vocab_size": 512},
        "train": {"max_steps": 3, "batch_size": 2, "eval_batches": 1, "eval_every": 0},
        "memory": {"offload_policy": "auto", "host_budget": str(budget),
                   "device_budget": "6MiB", "hardware": "cpu"},
        "run": {"out": str(tmp_path), "device": "cpu"},
    })
    t = Trainer(cfg, log=lambda _m: None)
    assert any(p.state_tier == Tier.DISK for p in t.plan.placements)
    t.train()
    assert t.stepper.ledger.peak_tier_bytes[Tier.HOST] <= budget
    assert t.stepper.ledger.peak_tier_bytes[Tier.DEVICE] <= 6 * 2**20
    t.stepper.close()


def test_auto_refuses_an_impossible_budget_before_the_first_step(tmp_path, capsys):
    rc = main(["train", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "r"),
               "--offload-policy", "auto", "--hardware", "cpu", "--device-budget", "64KiB",
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "no plan fits" in err and "would fit with" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_probe_measures_and_detect_uses_it(tmp_path, monkeypatch):
    from tierlm.memory import hardware
    from tierlm.memory.probe import run_probe

    out = tmp_path / "probe.json"
    monkeypatch.setattr(hardware, "probe_path", lambda: out)
    result = run_probe(str(tmp_path), out, disk_mib=16, log=lambda _m: None)
    for key in ("disk_read_Bps", "disk_write_Bps", "host_copy_Bps", "cpu_adam_params_per_s",
                "matmul_flops"):
        assert result[key] > 0
    prof = hardware.detect(tmp_path)
    assert prof.cpu_adam_params_per_s == result["cpu_adam_params_per_s"]
    assert prof.disk_read_Bps == result["disk_read_Bps"]
    assert prof.host_memory_bytes > 2**30 and prof.disk_budget_bytes > 0


def test_named_profiles_and_overrides():
    from tierlm.config import ConfigError
    from tierlm.memory.hardware import resolve

    p = resolve("rtx4090", host_memory_bytes=64 * GiB)
    assert p.gpu_memory_bytes == 24 * 10**9 and p.host_memory_bytes == 64 * GiB
    assert p.fp8_matmul_flops and not PROFILES["rtx3090"].fp8_matmul_flops
    with pytest.raises(ConfigError, match="unknown profile; known: auto, rtx3090"):
        resolve("gtx1080")


def test_precision_auto_takes_bf16_only_where_native():
    from tierlm.train.planning import resolve_precision

    assert resolve_precision("auto", torch.device("cpu"), None) == "fp32"
    assert resolve_precision("auto", None, PROFILES["rtx3090"]) == "bf16"
    # fp8 only where the profile has fp8 units, or where the user asks for emulation
    assert resolve_precision("auto", None, PROFILES["rtx4090"]) == "fp8"
    assert resolve_precision("auto", torch.device("cpu"), None, fp8_emulate=True) == "fp8"
    assert resolve_precision("bf16", torch.device("cpu"), None) == "bf16"


def test_fp8_plans_count_fp8_matmul_rate_and_halved_weight_traffic():
    """7B on a 24 GB card with blocks streamed from host RAM: fp8 moves about half the H2D
    bytes of bf16 (1 byte per block weight instead of 2) and computes the blocks' matmuls at
    the fp8 rate; fp32 sends the masters (4 bytes)."""
    shape = ModelShape.from_config(preset_config("7b"))
    hw = PROFILES["rtx4090"]
    n = len(shape.names)
    placements = ([SegmentPlacement(True, Tier.HOST)]
                  + [SegmentPlacement(False, Tier.HOST)] * (n - 2)
                  + [SegmentPlacement(True, Tier.HOST)])
    plans = {m: evaluate(shape, TrainShape(1, 2048, 4, m), hw, placements, "layer-outer", False,
                         usable_budgets(hw)) for m in ("fp32", "bf16", "fp8")}
    h2d = {m: p.moved_bytes["h2d"] for m, p in plans.items()}
    assert 0.49 < h2d["fp8"] / h2d["bf16"] < 0.55
    assert 0.49 < h2d["bf16"] / h2d["fp32"] < 0.55
    blocks = sum(shape.numels[1:-1])
    assert plans["bf16"].host_by_class["compute"] == pytest.approx(2 * blocks, rel=0.01)
    assert plans["fp8"].host_by_class["compute"] == pytest.approx(blocks, rel=0.01)
    assert plans["fp8"].times_s["compute"] < 0.6 * plans["bf16"].times_s["compute"]

"""--tf32: fp32 matmuls are planned at the rate they run at (IEEE fp32 unless TF32 is enabled),
and the flag enables TF32 on CUDA only."""

import json

import pytest
import torch

from tierlm.cli import main
from tierlm.memory.hardware import PROFILES
from tierlm.precision import set_tf32


def _compute_s(capsys, *flags: str) -> float:
    rc = main(["plan", "--model-size", "tiny", "--precision", "fp32", "--json",
               "--no-optimizer-table", *flags])
    assert rc == 0
    return json.loads(capsys.readouterr().out)["times_s"]["compute"]


@pytest.mark.parametrize("hw", ["a100-80g", "h100-80g", "rtx4090"])
def test_fp32_compute_is_planned_at_ieee_rate_unless_tf32(hw, capsys):
    ieee = _compute_s(capsys, "--hardware", hw)
    tf32 = _compute_s(capsys, "--hardware", hw, "--tf32")
    prof = PROFILES[hw]
    # the compute lane scales with the peak rate the precision runs at
    assert ieee / tf32 == pytest.approx((prof.matmul_flops / 2) / prof.fp32_matmul_flops,
                                        rel=1e-9)
    if hw != "rtx4090":  # datacenter cards: TF32 is 8x IEEE fp32; a GeForce's are equal
        assert ieee / tf32 > 7


def test_bf16_and_cpu_plans_do_not_read_the_flag(capsys):
    assert _compute_s(capsys, "--hardware", "cpu") == _compute_s(capsys, "--hardware", "cpu",
                                                                 "--tf32")
    rc = main(["plan", "--model-size", "tiny", "--precision", "bf16", "--hardware", "a100-80g",
               "--json", "--no-optimizer-table"])
    bf16 = json.loads(capsys.readouterr().out)["times_s"]["compute"]
    rc |= main(["plan", "--model-size", "tiny", "--precision", "bf16", "--hardware",
                "a100-80g", "--json", "--no-optimizer-table", "--tf32"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["times_s"]["compute"] == bf16


def test_a_profile_without_its_ieee_rate_is_planned_as_tf32():
    prof = PROFILES["a100-80g"].with_overrides()
    unknown = type(prof)(**{**prof.__dict__, "fp32_matmul_flops": None})
    assert unknown.fp32_compute_flops(tf32=False) == prof.matmul_flops / 2
    assert PROFILES["cpu"].fp32_compute_flops(tf32=False) == PROFILES["cpu"].matmul_flops


def test_set_tf32_enables_cuda_tf32_and_says_so_elsewhere():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    logged: list[str] = []
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        set_tf32(False, torch.device("cuda"), log=logged.append)
        assert not torch.backends.cuda.matmul.allow_tf32 and logged == []
        set_tf32(True, torch.device("cpu"), log=logged.append)
        assert not torch.backends.cuda.matmul.allow_tf32
        assert "no effect on device cpu" in logged[-1]
        set_tf32(True, torch.device("cuda"), log=logged.append)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert "TF32" in logged[-1] and "--tf32" in logged[-1]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_plan_text_names_the_fp32_rate(capsys):
    main(["plan", "--model-size", "tiny", "--precision", "fp32", "--hardware", "a100-80g",
          "--no-optimizer-table"])
    assert "fp32 (IEEE, 20 TFLOPS peak; --tf32 for the tensor cores)" in capsys.readouterr().out

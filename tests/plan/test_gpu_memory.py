"""--gpu-memory: the planner's device tier is the size given (a profile's card stands in for a
smaller one), and a CUDA run caps its own allocations there."""

import json
from types import SimpleNamespace

import torch

from tierlm.cli import main
from tierlm.config import from_dict
from tierlm.plan.inputs import cap_gpu_memory

GiB = 2**30


def _plan(capsys, *flags):
    assert main(["plan", "--model-size", "350m", "--hardware", "rtx4090", "--offload-policy",
                 "auto", "--no-optimizer-table", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_gpu_memory_sizes_the_planned_device_tier(capsys):
    """A 350M model's AdamW state (5.8 GB) fits the profile's 24 GB card on the device; with
    --gpu-memory 3GiB the device budget is cut to that card and the plan moves state to the
    host."""
    card = _plan(capsys)
    small = _plan(capsys, "--gpu-memory", "3GiB")
    assert card["fits"] and small["fits"]
    assert card["budgets"]["device"] > 3 * GiB >= small["budgets"]["device"] > GiB
    assert card["host_peak_bytes"] == 0 < small["host_peak_bytes"]
    assert small["device_peak_bytes"] <= small["budgets"]["device"] < card["device_peak_bytes"]


def test_gpu_memory_caps_a_cuda_runs_allocations(monkeypatch):
    """On CUDA the process may allocate the fraction of the card --gpu-memory names (never
    above all of it); a CPU run and a run without the flag set nothing."""
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: fractions.append((fraction, device)))
    cuda = torch.device("cuda", 0)
    cap_gpu_memory(from_dict({"memory": {"gpu_memory": "24GiB"}}), cuda)
    cap_gpu_memory(from_dict({"memory": {"gpu_memory": "100GiB"}}), cuda)
    cap_gpu_memory(from_dict({"memory": {"gpu_memory": "24GiB"}}), torch.device("cpu"))
    cap_gpu_memory(from_dict({}), cuda)
    assert fractions == [(24 / 80, cuda), (1.0, cuda)]

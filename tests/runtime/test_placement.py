"""The placement report counts what the engine holds, by the engine's own rules
(tierlm.runtime.state.persistent_bytes and load_bytes, tierlm.runtime.cache.window_bytes,
tierlm.runtime.schedule.grad_landing), so the two cannot drift: right after the engine is built,
the report's disk bytes are the ledger's, its host bytes the ledger's plus the staging it
reserves (one disk-tier update and one streamed read, each the largest of any disk segment, and
one gradient landing), its device bytes the ledger's plus the stream cache, one segment's
gradient in flight and the activation reserve. A step then stays within the report on every
tier."""

import contextlib

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, bf16_autocast, bf16_model, tiny_model
from tierlm.config import LoraConfig
from tierlm.finetune.lora import apply_lora
from tierlm.memory.placement import SegmentPlacement, update_staging_bytes
from tierlm.memory.tiers import Tier
from tierlm.runtime import Engine, EngineOptions, build_engine
from tierlm.runtime.schedule import grad_landing
from tierlm.runtime.state import load_bytes

CPU = torch.device("cpu")
M = 2
LORA = LoraConfig(rank=4, alpha=8.0)
HOST_GRAD = [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(False, Tier.DISK, Tier.HOST),
             SegmentPlacement(True, Tier.DISK, Tier.HOST), SegmentPlacement(False, Tier.HOST)]


def _model(name: str, kind: str) -> torch.nn.Module:
    model = tiny_model(name, layers=2)
    if kind.startswith("lora"):
        apply_lora(model, LORA, seed=3)
    return bf16_model(model) if "bf16" in kind else model


def _copy_bytes(st) -> int | None:
    return None if st.compute_format is None else st.compute_format.nbytes


def staging_reserved(eng: Engine) -> int:
    """Host staging of the largest disk-tier update (master, slots and the gradient unless it
    waits in RAM, chunk by chunk or whole) plus the largest streamed read of a disk segment,
    plus the gradient landings of trained segments off the device (the step's ring and the
    largest landing's own staging), from the engine's segment states."""
    disk = [st for st in eng.states if st.tier == Tier.DISK]
    update = max((0 if st.frozen else update_staging_bytes(
        st.numel, sum(st.slot(c).nbytes(st.layout) for c in st.state_copies)
        + (0 if st.placement.host_grad else 4 * st.numel), _copy_bytes(st),
        whole=eng.optimizer.align == 0, chunk_numel=eng.chunk_numel) for st in disk), default=0)
    read = max((load_bytes(Tier.DISK, st.numel, _copy_bytes(st), eng.chunk_numel).staging_bytes
                for st in disk), default=0)
    # the gradient landings: the step's landing ring (the largest any landing adds through,
    # held for the step) beside the largest file pass's chunks
    paths = [(st.numel, grad_landing(st.tier, st.placement.gradient_tier, written=w, final=f))
             for st in eng.states if st.tier != Tier.DEVICE and not st.frozen
             for w in (False, True) for f in (False, True)]
    ring = max((4 * p.ring_numel(n, eng.chunk_numel) for n, p in paths), default=0)
    own = max((4 * p.host_staging_numel(n, eng.chunk_numel) for n, p in paths), default=0)
    return update + read + ring + own


@pytest.mark.parametrize(("name", "kind", "policy", "extra"), [
    ("llama_tied_gqa", "fp32", "host", {"resident": "embed"}),
    ("llama_tied_gqa", "fp32", "disk", {}),
    ("gpt2", "fp32", "disk", {"staging_chunk_numel": 1024}),  # chunked staging
    ("llama_untied", "fp32", "auto", {"placements": HOST_GRAD}),  # gradients held on the host
    ("llama_untied", "bf16", "tiered", {"device_budget_bytes": 800_000,
                                        "host_budget_bytes": 1_100_000}),
    ("llama_tied_gqa", "bf16", "disk", {}),
    ("gpt2", "bf16", "auto", {"placements": HOST_GRAD}),
    ("llama_tied_gqa", "lora", "disk", {}),
    ("llama_tied_gqa", "lora-bf16", "host", {"base_format": "bf16"}),
])
def test_report_is_the_ledger_after_construction_plus_the_reserves(name, kind, policy, extra,
                                                                   tmp_path):
    eng = build_engine(_model(name, kind), OPTIM, EngineOptions(
        policy=policy, offload_dir=str(tmp_path), batch_size=2, seq_len=16, micro_batches=M,
        autocast=bf16_autocast if "bf16" in kind else contextlib.nullcontext, **extra),
        device=CPU)
    report, led = eng.report, eng.ledger
    tiers = {p.state_tier for p in report.placements}
    assert tiers - {Tier.DEVICE}, "every case keeps some state off the device"
    if "bf16" in kind:
        assert any(st.compute_format is not None for st in eng.states if st.tier != Tier.DEVICE)
    assert report.disk_bytes == led.tier_bytes(Tier.DISK)
    staging = staging_reserved(eng)
    # trained state off the device lands its gradients through staging; a frozen base only
    # stages what it reads from disk
    assert (staging > 0) == (Tier.DISK in tiers or not kind.startswith("lora"))
    assert report.host_bytes == led.tier_bytes(Tier.HOST) + staging
    # an action's gradient of trained state off the device waits there until it lands, beside
    # the one before it, still landing: the two largest; a LoRA run's adapters (device state,
    # in the ledger) are what the engine adds to the activation reserve it passes, not a
    # second time here
    grad = sum(sorted((4 * st.numel for st in eng.states
                       if st.tier != Tier.DEVICE and not st.frozen), reverse=True)[:2])
    assert report.device_bytes == (led.tier_bytes(Tier.DEVICE) + eng.cache.capacity_bytes + grad
                                   + eng.activation_bytes + eng.activation_reserve_bytes)
    eng.step(batches(1, M)[0], 1e-3)
    for tier, reported in ((Tier.DEVICE, report.device_bytes), (Tier.HOST, report.host_bytes),
                           (Tier.DISK, report.disk_bytes)):
        assert led.step_peak_tier_bytes[tier] <= reported, tier
    eng.close()

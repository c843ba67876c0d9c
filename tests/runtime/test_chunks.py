"""Disk-tier state crosses host staging in chunks, and the tied embedding's gradient is held once
per micro-batch in flight: the math is unchanged (bit for bit against the one-chunk run and
close to the reference trainer), the host staging peak is a few chunks, and the planner counts
both as the ledger does."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.runtime_helpers import (
    OPTIM,
    assert_close_run,
    batches,
    new_engine,
    reference_run,
    tiny_model,
)
from tierlm.memory import Tier
from tierlm.memory.hardware import PROFILES
from tierlm.memory.placement import SegmentPlacement, chunk_ranges, staging_numel
from tierlm.memory.tiers import TensorClass
from tierlm.models.testing import tiny_hf_configs
from tierlm.plan.evaluate import evaluate
from tierlm.plan.result import usable_budgets
from tierlm.runtime import Engine
from tierlm.runtime.shapes import ModelShape, TrainShape

CPU = torch.device("cpu")
B, T = 2, 16
CHUNK = 1024  # elements: splits every segment of the tiny models, and groups inside them


def _engine(model, tmp_path, *, chunk: int | None = None, **kw) -> Engine:
    extra = {} if chunk is None else {"staging_chunk_numel": chunk}
    return new_engine(model, tmp_path, **extra, **kw)


def _run(model, tmp_path, steps, lrs, **kw):
    eng = _engine(model, tmp_path, **kw)
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    out = (recs, eng.weights(), eng.optimizer_state(), eng.ledger)
    eng.close()
    return out


@pytest.mark.parametrize("order,m", [("microbatch-outer", 3), ("layer-outer", 2)])
def test_chunked_disk_update_is_bit_exact(order, m, tmp_path):
    base = tiny_model("llama_tied_gqa", layers=2)
    eng = _engine(copy.deepcopy(base), tmp_path / "probe", chunk=CHUNK, policy="disk")
    # the chunks cut optimizer groups in the middle, so a group's counter must advance once
    # per step however many chunks it spans
    cut = [st for st in eng.states
           if any(start % CHUNK or (start + n) % CHUNK
                  for start, n, _ in st.layout.groups() if n > CHUNK)]
    assert cut and all(len(chunk_ranges(st.numel, CHUNK)) > 1 for st in cut)
    eng.close()
    steps = batches(3, m)
    lrs = [OPTIM.lr, OPTIM.lr * 0.9, OPTIM.lr * 0.8]
    kw = {"policy": "disk", "microbatch_order": order, "micro_batches": m, "grad_clip": 0.05}
    chunked = _run(copy.deepcopy(base), tmp_path / "chunked", steps, lrs, chunk=CHUNK, **kw)
    whole = _run(copy.deepcopy(base), tmp_path / "whole", steps, lrs, **kw)
    for a, b in zip(chunked[0], whole[0], strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for got, want in ((chunked[1], whole[1]), (chunked[2], whole[2])):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    assert all(v.item() == len(steps) for k, v in chunked[2].items() if k.endswith(".step"))
    ref_recs, ref_weights = reference_run(copy.deepcopy(base), steps, lrs, 0.05)
    assert_close_run([r["loss"] for r in chunked[0]], [r["loss"] for r in ref_recs],
                     chunked[1], ref_weights)


def test_host_staging_peak_is_a_few_chunks(tmp_path):
    model = tiny_model("llama_untied", layers=2)
    m = 2
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    placements = [SegmentPlacement(False, Tier.DISK)] * len(shape.names)
    hw = PROFILES["rtx4090"]
    predicted = evaluate(shape, TrainShape(B, T, m), hw, placements, "microbatch-outer", True,
                         usable_budgets(hw), chunk_numel=CHUNK)
    eng = _engine(model, tmp_path, chunk=CHUNK, policy="disk", micro_batches=m)
    for step in batches(3, m):
        eng.step(step, OPTIM.lr)
    eng.synchronize()
    led = eng.ledger
    eng.close()
    largest = max(shape.numels)
    # one update (two sets of master, gradient and moments) and one streamed read (two chunks)
    bound = (2 * 4 + 2) * CHUNK * 4
    assert 4 * largest > bound  # one segment's master alone would not fit in the bound
    assert led.tier_bytes(Tier.HOST) == 0
    assert 16 * staging_numel(largest, CHUNK) <= led.peak_tier_bytes[Tier.HOST] <= bound
    assert led.peak_class_bytes[(Tier.HOST, TensorClass.STAGING)] <= bound
    # the planner replays the same chunks: device bytes exactly, host staging as a bound
    assert led.peak_tier_bytes[Tier.DEVICE] == predicted.device_peak_bytes
    assert led.peak_tier_bytes[Tier.HOST] <= predicted.host_peak_bytes <= bound


def _tied_model(vocab: int) -> torch.nn.Module:
    cfg = copy.deepcopy(tiny_hf_configs(vocab_size=vocab)["llama_tied_gqa"])
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


@pytest.mark.parametrize("order,m", [("microbatch-outer", 2), ("layer-outer", 2)])
def test_tied_embedding_gradient_is_held_once_per_micro_batch(order, m, tmp_path):
    # a vocabulary large enough that the embedding is the largest segment, as in real models
    model = _tied_model(4000)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    assert shape.tied_numel == shape.numels[0] == max(shape.numels)
    eng = _engine(model, tmp_path, policy="host", microbatch_order=order, micro_batches=m)
    for step in batches(2, m, seed=3):
        eng.step([b % 4000 for b in step], OPTIM.lr)
    led = eng.ledger
    eng.close()
    # one embedding gradient per micro-batch in flight: the head's contribution, which the
    # owner's own joins, the first of them being the step's gradient (no zeroed temporary, no
    # separate accumulator); beside them, from the head to the embedding's backward, the
    # gradient of the segment running, and at most one gradient still landing into host RAM
    # (the engine's landing worker)
    in_flight = m if order == "layer-outer" else 1
    held = in_flight * 4 * shape.numels[0] + 4 * max(shape.numels[1:])
    grad_bytes = led.peak_class_bytes[(Tier.DEVICE, TensorClass.GRAD)]
    assert held < grad_bytes <= held + 4 * max(shape.numels)
    hw = PROFILES["rtx4090"]
    placements = [SegmentPlacement(False, Tier.HOST)] * len(shape.names)
    predicted = evaluate(shape, TrainShape(B, T, m), hw, placements, order, True,
                         usable_budgets(hw))
    assert predicted.device_by_class["grad"] == grad_bytes
    assert led.peak_tier_bytes[Tier.DEVICE] == predicted.device_peak_bytes


def test_checkpoint_shards_of_disk_state_read_one_parameter_at_a_time(tmp_path):
    """A checkpoint of disk-tier state reads each parameter's slice when its bytes are written:
    host staging holds one parameter (plus O_DIRECT alignment), not a segment's three copies,
    and the file holds exactly the engine's weights and moments."""
    from tierlm.checkpoint import SafetensorsFile, write_safetensors

    eng = _engine(tiny_model("llama_tied_gqa", layers=2), tmp_path / "off", policy="disk",
                  chunk=CHUNK)
    eng.step(batches(1, 1)[0], OPTIM.lr)
    want = {**eng.weights(), **eng.optimizer_state()}
    sizes = []
    alloc = eng.store.alloc

    def counting_alloc(tier, cls, numel, dtype=torch.float32, **kw):
        if cls == TensorClass.STAGING:
            sizes.append(numel)
        return alloc(tier, cls, numel, dtype, **kw)

    eng.store.alloc = counting_alloc
    got = {}
    for name, weights, optim in eng.state_shards():
        for kind, tensors in (("model", weights), ("optim", optim)):
            path = tmp_path / f"{kind}-{name}.safetensors"
            write_safetensors(path, tensors)
            f = SafetensorsFile(path)
            got.update({k: f.read(k) for k in tensors})
    largest = max(s.numel for st in eng.states for s in st.layout.slots)
    segment = max(st.numel for st in eng.states)
    assert sizes and max(sizes) <= largest + 1024 < segment
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # and back: a resume rewrites the disk tier's files chunk by chunk, moments and counters too
    weights = {k: v for k, v in got.items() if "." not in k.rsplit("weight", 1)[-1]}
    optim = {k: v for k, v in got.items() if k not in weights}
    eng.close()
    torch.manual_seed(1)  # another model's initial weights, then the checkpoint's
    fresh = _engine(tiny_model("llama_tied_gqa", layers=2), tmp_path / "fresh", policy="disk",
                    chunk=CHUNK)
    assert not any(torch.equal(v, want[k]) for k, v in fresh.optimizer_state().items()
                   if k.endswith("exp_avg"))  # zero moments before the load
    alloc = fresh.store.alloc
    fresh.store.alloc = counting_alloc
    sizes.clear()
    fresh.load(weights, optim)
    assert max(sizes) <= CHUNK
    reloaded = {**fresh.weights(), **fresh.optimizer_state()}
    fresh.close()
    for k, v in want.items():
        assert torch.equal(reloaded[k], v), k

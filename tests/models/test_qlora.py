"""--finetune qlora: NF4 (double-quantised scales) within the error its code implies, and the
tiered runtime with an NF4 base streamed from host or disk reproducing plain PyTorch (peft LoRA on
the same round-tripped base), that base unchanged, the adapter loading with peft, and the planner
counting the NF4 bytes."""

import copy

import pytest
import torch

from tests.comparisons import comparison_module
from tests.runtime_helpers import (
    OPTIM,
    batches,
    bf16_autocast,
    bf16_lora_reference,
    bf16_model,
    new_engine,
    steps_match_the_plan,
    tiny_model,
)
from tierlm.config import LoraConfig, from_dict
from tierlm.finetune.lora import apply_lora
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.precision.nf4 import (
    BLOCK,
    SCALE_BLOCK,
    decode_workspace_nbytes,
    dequantise,
    dequantised_scales,
    nf4_levels,
    nf4_nbytes,
    quantise,
    quantise_in_place,
    quantised_names,
    round_trip,
)
from tierlm.runtime import Engine
from tierlm.runtime.reference import ReferenceStep

CPU = torch.device("cpu")
STEPS, M, CLIP = 4, 2, 0.05
LORA = LoraConfig(rank=4, alpha=8.0)
# the NF4 code as the QLoRA paper and bitsandbytes publish it (4-bit NormalFloat)
PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def test_levels_are_the_published_nf4_code():
    assert torch.allclose(nf4_levels(), torch.tensor(PUBLISHED), atol=1e-6)


@pytest.mark.parametrize("numel", [128, 64 * 256, 64 * 1000])  # scale groups: 1, 1, 4 (short)
def test_round_trip_error_within_the_bound_per_block(numel):
    g = torch.Generator().manual_seed(numel)
    # blocks of very different magnitudes, so the double quantisation of the scales matters
    x = torch.randn(numel, generator=g) * torch.rand(numel // BLOCK, generator=g).repeat_interleave(
        BLOCK) * 3
    x[BLOCK:2 * BLOCK] = 0  # an all-zero block decodes to zeros
    buf = quantise(x, torch.empty(nf4_nbytes(numel), dtype=torch.uint8))
    y = dequantise(buf, numel)
    groups = -(-numel // BLOCK // SCALE_BLOCK)  # 4 bits a weight, 8 a block, 32 a group + mean
    assert nf4_nbytes(numel) == numel // 2 + numel // BLOCK + 4 * groups + 4
    levels = nf4_levels()
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    s = x.view(-1, BLOCK).abs().amax(1)  # the true absmax of each block
    s_hat = dequantised_scales(buf, numel)  # as stored: the int8 + fp32 step + mean
    # each scale is off by at most half its group's step (the step: max |centred scale| / 127)
    centred = s - s.mean()
    step = torch.stack([centred[i * SCALE_BLOCK:(i + 1) * SCALE_BLOCK].abs().max() / 127
                        for i in range(groups)]).repeat_interleave(SCALE_BLOCK)[:len(s)]
    assert ((s_hat - s).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    err = (x - y).view(-1, BLOCK).abs().amax(1)
    bound = half_gap * s + (s_hat - s).abs()  # rounding to the nearest level + the scale's error
    assert (err <= bound * (1 + 1e-5) + 1e-7).all()
    assert y[BLOCK:2 * BLOCK].eq(0).all()
    assert torch.equal(round_trip(x), y)


def test_matches_torchao_nf4():
    """torchao's NF4Tensor (the module moved in 0.18) picks the same level for every weight
    but ties, and its dequantised values differ only by its own rounding of the double-quantised
    scales (measured with torchao 0.18: 99.994% of codes equal, median difference 2e-4 of the
    block's absmax)."""
    nf4 = comparison_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    x = torch.randn(64 * 256 * 2, generator=torch.Generator().manual_seed(0))
    theirs = nf4.to_nf4(x.view(128, 256), block_size=BLOCK, scaler_block_size=SCALE_BLOCK)
    theirs = theirs.get_original_weight().reshape(-1).float()
    ours = round_trip(x)
    levels = nf4_levels()

    def codes(y):
        blocks = y.view(-1, BLOCK)
        scaled = blocks / blocks.abs().amax(1, keepdim=True)
        return (scaled.unsqueeze(-1) - levels).abs().argmin(-1)

    assert (codes(theirs) == codes(ours)).float().mean().item() >= 0.999
    absmax = x.view(-1, BLOCK).abs().amax(1, keepdim=True)
    assert ((theirs - ours).view(-1, BLOCK) / absmax).abs().median().item() <= 1e-3


def _qlora_model(name: str = "llama_tied_gqa") -> torch.nn.Module:
    model = tiny_model(name, layers=2)
    apply_lora(model, LORA, seed=3)
    return model


@pytest.fixture(scope="module")
def reference():
    """The wrapped fp32 model, batches and lrs, and peft LoRA trained in plain PyTorch on its
    NF4 round-tripped base: records, adapters and that base."""
    base = _qlora_model()
    steps = batches(STEPS, M)
    lrs = [OPTIM.lr * (1 - 0.1 * i) for i in range(STEPS)]
    model = copy.deepcopy(base)
    quantise_in_place(model)
    ref = ReferenceStep(model, OPTIM, grad_clip=CLIP, device=CPU)
    recs = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    return base, steps, lrs, recs, ref.weights(), frozen


def _engine(model, tmp_path, policy, order="microbatch-outer", **kw) -> Engine:
    return new_engine(model, tmp_path / "offload", policy=policy, microbatch_order=order,
                      grad_clip=CLIP, micro_batches=M, base_format="nf4", **kw)


@pytest.mark.parametrize(("policy", "order"), [("host", "microbatch-outer"),
                                               ("disk", "layer-outer"), ("none", "layer-outer")])
def test_tiered_qlora_matches_peft_on_the_round_tripped_base(reference, policy, order, tmp_path):
    base, steps, lrs, ref_recs, ref_adapters, ref_frozen = reference
    model = copy.deepcopy(base)  # fp32: the runtime quantises at load
    names = quantised_names(model)
    assert names and all(".base_layer.weight" in n for n in names)
    eng = _engine(model, tmp_path, policy, order)
    blocks = [st for st in eng.states if st.compute_format is not None]
    assert len(blocks) == 2 and all(st.master is None and st.frozen for st in blocks)
    tier = {"none": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}[policy]
    assert {st.tier for st in eng.states} == {tier}
    # the base's blocks are held as NF4 bytes: ~0.52 B per quantised weight, fp32 for the rest
    for st in blocks:
        quantised = sum(s.numel for s in st.layout.slots if s.name in names)
        assert st.compute_format.nbytes < 4 * (st.numel - quantised) + 0.6 * quantised + 16 * 12
    held = eng.ledger.tier_bytes(tier)
    decoded = eng.frozen_weights()
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    assert eng.ledger.tier_bytes(tier) == held
    adapters, after = eng.weights(), eng.frozen_weights()
    eng.close()
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for k, v in ref_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= 1e-6, k
    # the decoded base is the reference's round trip bit for bit, and the same after training
    assert decoded.keys() == after.keys() == ref_frozen.keys()
    assert all(torch.equal(decoded[k], ref_frozen[k]) and torch.equal(after[k], decoded[k])
               for k in decoded)
    assert any(not torch.equal(decoded[k], base.get_parameter(k).detach()) for k in names)


class _LiveDecodes:
    """Wraps tierlm.precision.nf4._decode_weight (what NF4Linear decodes each matmul's weight
    with): records every decoded weight and, at each decode, how many earlier ones are still
    alive, so a decode kept by the graph or a whole segment's decode shows up."""

    def __init__(self, monkeypatch) -> None:
        import weakref

        from tierlm.precision import nf4

        self.alive: list[weakref.ref] = []
        self.most_alive = self.largest_bytes = self.calls = 0
        decode = nf4._decode_weight

        def counted(*args):
            self.alive = [r for r in self.alive if r() is not None]
            w = decode(*args)
            self.alive.append(weakref.ref(w))
            self.most_alive = max(self.most_alive, len(self.alive))
            self.largest_bytes = max(self.largest_bytes, w.numel() * w.element_size())
            self.calls += 1
            return w

        monkeypatch.setattr(nf4, "_decode_weight", counted)


@pytest.mark.parametrize(("acts", "order"), [("full", "microbatch-outer"),
                                             ("offload", "layer-outer"),
                                             ("selective", "microbatch-outer")])
def test_qlora_decodes_one_weight_at_a_time_under_every_activation_policy(
        reference, acts, order, tmp_path, monkeypatch):
    """Each NF4 base layer decodes its own weight just before its matmul, forward, recompute
    and backward alike, and nothing keeps it: at most one decoded weight is alive at any
    decode, the largest is one linear's (what `decoded_nbytes` reserves room for, with the
    decode's temporaries), and the run still equals peft on the round-tripped base."""
    from tierlm.config import ActivationConfig

    base, steps, lrs, ref_recs, ref_adapters, _ = reference
    model = copy.deepcopy(base)
    names = quantised_names(model)
    eng = _engine(model, tmp_path, "host", order, activations=ActivationConfig(policy=acts))
    live = _LiveDecodes(monkeypatch)
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    adapters = eng.weights()
    block = eng.states[1]
    eng.close()
    largest = max(s.numel for s in block.layout.slots if s.name in names)
    assert live.most_alive == 1
    assert live.largest_bytes == 4 * largest
    assert block.compute_format.decoded_nbytes == decode_workspace_nbytes(largest, torch.float32)
    assert block.compute_format.decoded_nbytes < 4 * block.numel / 2  # a segment's: 4 * numel
    # forward and backward of every micro-batch decode each weight; a recompute (full, and
    # selective: the decode is one of the cheap ops it reruns) once more
    per_pass = len(names) * M * STEPS
    assert live.calls == per_pass * (2 if acts == "offload" else 3)
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for k, v in ref_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= 1e-6, k


@pytest.mark.parametrize(("policy", "order", "fp32_layers"), [
    ("host", "layer-outer", None),
    ("none", "microbatch-outer", "lora_"),  # the adapters' matmuls fp32 on bf16 activations
])
def test_tiered_qlora_under_bf16_matches_peft_on_the_bf16_round_trip(policy, order, fp32_layers,
                                                                       tmp_path):
    """--finetune qlora --precision bf16: NF4 bytes on the tier, decoded per action straight
    into bf16 (norms fp32), adapters fp32 with fp32 AdamW state; equal to peft in plain PyTorch
    on the NF4 round trip cast to bf16, under the same bf16 policy and autocast. Written: the
    adapters, gradient norms and base came out bitwise equal, the loss within 2.4e-7 (its
    last bit: the runtime sums micro-batch losses in float64)."""
    base = bf16_model(_qlora_model(), fp32_layers)
    adapter = base.model.layers[0].self_attn.q_proj.lora_A["default"]
    assert adapter.compute.name == ("fp32" if fp32_layers else "bf16")
    steps, lrs = batches(3, M), [OPTIM.lr * (1 - 0.1 * i) for i in range(3)]
    ref_recs, ref_adapters, ref_frozen = bf16_lora_reference(base, steps, lrs, CLIP, nf4=True)
    eng = _engine(copy.deepcopy(base), tmp_path, policy, order, autocast=bf16_autocast)
    blocks = [st for st in eng.states if st.compute_format is not None]
    assert len(blocks) == 2 and all(st.master is None for st in blocks)
    for st in blocks:  # each quantised weight decodes into bf16 per matmul, one at a time
        fmt = st.compute_format
        largest = max(s.numel for s in st.layout.slots if s.name in quantised_names(base))
        assert fmt.decoded_nbytes == decode_workspace_nbytes(largest, torch.bfloat16)
        kinds = dict(zip([s.name for s in st.layout.slots], fmt.compute_kinds, strict=True))
        assert {kinds[n] for n in kinds if n in quantised_names(base)} == {"bf16"}
        assert {k for n, k in kinds.items() if "layernorm" in n} == {"fp32"}
    before = eng.frozen_weights()
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    adapters, after = eng.weights(), eng.frozen_weights()
    eng.close()
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    for k, v in ref_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= 1e-6, k
    assert before.keys() == after.keys() == ref_frozen.keys()
    assert all(torch.equal(before[k], ref_frozen[k]) and torch.equal(after[k], before[k])
               for k in before)


@pytest.mark.parametrize("acts", ["full", "offload"])
def test_qlora_bf16_decodes_per_matmul_under_recompute_and_offload(acts, tmp_path, monkeypatch):
    """Under bf16 each weight decodes straight into bf16 per matmul, one alive at a time, with
    recompute (full) and offloaded graphs, and the run equals peft on the bf16 round trip: the
    adapters bit for bit."""
    from tierlm.config import ActivationConfig

    base = bf16_model(_qlora_model())
    steps, lrs = batches(2, M), [OPTIM.lr, 0.9 * OPTIM.lr]
    ref_recs, ref_adapters, _ = bf16_lora_reference(base, steps, lrs, CLIP, nf4=True)
    eng = _engine(copy.deepcopy(base), tmp_path, "host", autocast=bf16_autocast,
                  activations=ActivationConfig(policy=acts))
    live = _LiveDecodes(monkeypatch)
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    adapters = eng.weights()
    largest = max(s.numel for s in eng.states[1].layout.slots
                  if s.name in quantised_names(base))
    eng.close()
    assert live.most_alive == 1 and live.largest_bytes == 2 * largest
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert all(torch.equal(adapters[k], v) for k, v in ref_adapters.items())


CYCLE = torch.tensor([3, 17, 42, 99, 150])  # the text: these five tokens over and over


def _pattern(rows: int, t: int, start: int) -> torch.Tensor:
    """(rows, t + 1) tokens of CYCLE, each row from its own phase."""
    return torch.stack([CYCLE[torch.arange(start + r, start + r + t + 1) % len(CYCLE)]
                        for r in range(rows)])


def test_qlora_learns_and_its_adapter_loads_with_peft_on_the_round_tripped_base(tmp_path):
    """Held-out loss falls on tiny (a base streamed from disk); the adapter, saved in peft's
    format, loads with PeftModel.from_pretrained on the NF4 round-tripped base and gives the
    runtime's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tierlm.finetune.lora import save_adapter

    plain = tiny_model("llama_tied_gqa", layers=2)
    plain.save_pretrained(tmp_path / "base")
    model = copy.deepcopy(plain)
    apply_lora(model, LORA, seed=3)
    eng = _engine(model, tmp_path, "disk")
    held_out = _pattern(4, 16, 3)
    before = eng.eval_loss(held_out)
    for k in range(6):
        eng.step([_pattern(2, 16, 2 * k), _pattern(2, 16, 2 * k + 1)], 2e-2)
    after = eng.eval_loss(held_out)
    ids = held_out[:1, :12]
    trained = eng.next_token_logits(ids)
    save_adapter(tmp_path / "adapter", model, LORA, eng.weights())
    eng.close()
    assert after < 0.9 * before, (before, after)  # 5.75 -> 4.93 when written

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    quantise_in_place(peft_model)  # the base weights peft wrapped: their NF4 round trip
    with torch.no_grad():
        got = peft_model.eval()(input_ids=ids).logits[0, -1]
    assert (got - trained).abs().max().item() <= 1e-5


def test_qlora_run_learns_and_writes_adapter_and_merged_export(tmp_path):
    """Held-out loss falls on tiny; RUN_DIR/adapter loads with PeftModel.from_pretrained on the
    round-tripped base and gives the trained logits; the merged export gives them too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tierlm.checkpoint import export_hf_from_checkpoint
    from tierlm.data import train_bpe_tokenizer
    from tierlm.finetune.lora import lora_targets
    from tierlm.models import build_model
    from tierlm.models.testing import tiny_hf_configs
    from tierlm.train.trainer import Trainer

    text = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}."
                     for i in range(300))
    src = tmp_path / "src"
    build_model(tiny_hf_configs(vocab_size=300)["llama_tied_gqa"], seed=0).save_pretrained(src)
    train_bpe_tokenizer([text], vocab_size=300).save_pretrained(src)
    (tmp_path / "corpus.txt").write_text(text)
    cfg = from_dict({
        "model": {"path": str(src)},
        "data": {"train": str(tmp_path / "corpus.txt"), "seq_len": 16},
        "train": {"finetune": "qlora", "max_steps": 6, "batch_size": 2, "grad_accum_steps": 1,
                  "eval_batches": 2, "eval_every": 0, "sample_tokens": 0},
        "lora": {"rank": 4, "alpha": 8.0},
        "optim": {"lr": 3e-2, "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "memory": {"offload_policy": "disk"},
        "run": {"out": str(tmp_path / "run"), "device": "cpu", "seed": 5},
    })
    trainer = Trainer(cfg, log=lambda _m: None)
    result = trainer.train()
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    trained = trainer.stepper.next_token_logits(ids)
    trainer.stepper.close()
    assert result.eval_ppl[6] < result.eval_ppl[0]  # held-out perplexity at step 0 and 6

    base = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for t in lora_targets(base, LORA.targets):
            w = base.get_submodule(t).weight
            w.copy_(round_trip(w))
    peft_model = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits[0, -1]
    assert (got - trained).abs().max().item() <= 1e-5
    hf = export_hf_from_checkpoint(result.final_checkpoint, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        assert (merged(input_ids=ids).logits[0, -1] - trained).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("spec", "precision"), [("mixed", "fp32"),  # device, disk, resident
                                                 ("mixed", "bf16")])  # host
def test_planner_counts_the_nf4_base(spec, precision, tmp_path):
    """The planner's replay of a QLoRA step predicts the ledger's device peak, disk bytes and
    moves exactly: the NF4 bytes are what the tiers hold and what crosses (in fp32 and bf16
    runs alike), and the engine reserves the decode buffer the planner counts."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime.shapes import ModelShape, TrainShape

    model = _qlora_model()
    shape = ModelShape.from_config(tiny_model("llama_tied_gqa", layers=2).config, optim=OPTIM,
                                   lora=LORA, base_format="nf4", precision=precision)
    if precision == "bf16":
        bf16_model(model)
    n = len(shape.names)
    placements = ([SegmentPlacement(False, Tier.HOST)] * n if spec == "host" else
                  [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(False, Tier.DISK),
                   SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(True, Tier.HOST)])
    hw = PROFILES["cpu"]
    predicted = evaluate(shape, TrainShape(2, 16, M, precision), hw, placements,
                         "microbatch-outer", True, usable_budgets(hw))
    eng = _engine(model, tmp_path, "auto", placements=placements,
                  **({"autocast": bf16_autocast} if precision == "bf16" else {}))
    decoded = [st.compute_format.decoded_nbytes for st in eng.states
               if st.compute_format is not None]
    assert max(decoded) == max(shape.base_decoded_bytes)
    # one matmul's weight (the largest target's, in the compute dtype) and the decode's
    # temporaries, less than decoding the segment whole (fp32, or bf16 with fp32 norms)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    largest = max(s.numel for s in eng.states[1].layout.slots if s.name in quantised_names(model))
    assert max(decoded) == decode_workspace_nbytes(largest, dtype)
    assert max(decoded) < dtype.itemsize * eng.states[1].numel
    steps_match_the_plan(eng, predicted, M)
    nf4 = [st.compute_format.nbytes for st in eng.states if st.compute_format is not None]
    assert sum(nf4) < 0.5 * sum(4 * st.numel for st in eng.states[1:-1])
    # fp32 masters are the segments without an NF4 weight (embed, head) only
    held = eng.ledger.current_bytes
    assert sum(held[(t, TensorClass.MASTER)] for t in Tier if t != Tier.DEVICE) == \
        sum(4 * st.numel for st in eng.states if st.compute_format is None
            and st.tier != Tier.DEVICE)
    eng.close()


def test_plan_refuses_qlora_over_ranks_as_train_does(capsys):
    """`tierlm plan --context-parallel 2` plans a run of 2 ranks, which LoRA/QLoRA do not
    have: refused with the flags to drop, not a plan ending in train flags that fail."""
    from tierlm.cli import main

    assert main(["plan", "--model-size", "tiny", "--hardware", "rtx4090", "--finetune",
                 "qlora", "--context-parallel", "2", "--no-optimizer-table"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--finetune qlora with --nproc > 1" in captured.err
    assert "drop --nproc, --context-parallel and --backend fsdp" in captured.err


def test_plan_counts_the_adapters_state_not_the_full_models(capsys):
    """Under --finetune qlora the state line and the optimizer table show the frozen base and
    the adapters' optimizer state, not full fine-tuning's 8 B per model parameter."""
    from tierlm.cli import main

    assert main(["plan", "--model-size", "tiny", "--hardware", "rtx4090", "--finetune",
                 "qlora"]) == 0
    out = capsys.readouterr().out
    state = next(line for line in out.splitlines() if line.startswith("model state by class"))
    assert state.startswith("model state by class: frozen base ")
    assert "AdamW state" in state and "(8.00 B/param)" in state
    rows = out.split("each optimizer (--opt) in this plan:")[1].strip().splitlines()[1:]
    adamw = next(r.split() for r in rows if r.split()[0] == "AdamW")
    lion = next(r.split() for r in rows if r.split()[0] == "Lion")
    assert adamw[3] == "8.00" and lion[3] == "4.00"  # B per trained parameter
    # the adapters of tiny's 2 blocks: rank 16 on 7 projections, well under a MiB of state
    assert adamw[2] == "KiB"


def test_plan_prints_full_lora_and_qlora_side_by_side(capsys):
    from tierlm.cli import main

    assert main(["plan", "--model-size", "1b", "--hardware", "rtx4060ti-16g", "--finetune",
                 "qlora", "--no-optimizer-table"]) == 0
    out = capsys.readouterr().out
    assert "--finetune qlora" in out.split("Train with:")[1]
    table = out.split("each fine-tuning method (--finetune) on this model and hardware:")[1]
    rows = {line.split()[0]: line.split() for line in table.strip().splitlines()[1:4]}
    assert set(rows) == {"full", "lora", "qlora"}
    # the card has fp8 units: full trains in fp8, lora and qlora in bf16 (no fp8 for them)
    assert rows["full"][1] == "fp8" and rows["lora"][1] == rows["qlora"][1] == "bf16"
    assert rows["lora"][2] == rows["qlora"][2]

    def gib(row, k):  # the k-th "<x> <unit>" column after the resident count
        value, unit = row[5 + 2 * k], row[6 + 2 * k]
        return float(value) * {"GiB": 1, "MiB": 2**-10, "KiB": 2**-20}[unit]

    # the NF4 base: no more held off the device and less peak on it than LoRA's bf16 base
    # (in bf16 both fit this 16 GiB card whole: 1.52 against 2.86 GiB when written)
    assert gib(rows["qlora"], 2) + gib(rows["qlora"], 3) <= gib(rows["lora"], 2) + gib(
        rows["lora"], 3)
    assert gib(rows["qlora"], 0) < 0.6 * gib(rows["lora"], 0)


def test_planner_counts_the_decode_time_per_matmul():
    """Every NF4 weight is decoded in each micro-batch's forward and backward, once more where
    its segment recomputes, at decode_traffic_bytes per weight over the device's memory
    bandwidth; the decode is part of the step's compute, and LoRA has none."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.plan.timing import _decode_s
    from tierlm.precision.nf4 import decode_traffic_bytes
    from tierlm.runtime.shapes import ModelShape, TrainShape

    config = tiny_model("llama_tied_gqa", layers=2).config
    hw = PROFILES["rtx4090"]
    resident = [SegmentPlacement(True, Tier.DEVICE)] * 4
    streamed = [SegmentPlacement(False, Tier.HOST)] * 4
    shapes = {p: ModelShape.from_config(config, optim=OPTIM, lora=LORA, base_format="nf4",
                                        precision=p) for p in ("fp32", "bf16")}
    nf4 = sum(shapes["fp32"].base_nf4_numels)
    assert nf4 == 2 * sum(s.numel() for s in _qlora_model().model.layers[0].parameters()
                          if s.numel() % BLOCK == 0 and not s.requires_grad and s.ndim == 2)
    for p, shape in shapes.items():
        dtype = torch.bfloat16 if p == "bf16" else torch.float32
        one = decode_traffic_bytes(nf4, dtype) / (hw.device_memory_Bps * 0.9)
        kept = _decode_s(shape, TrainShape(2, 16, M, p), hw, resident, True)
        assert kept == pytest.approx(2 * M * one)  # forward + backward, per micro-batch
        assert _decode_s(shape, TrainShape(2, 16, M, p), hw, streamed, True) == \
            pytest.approx(3 * M * one)  # and the recompute
    plan = evaluate(shapes["bf16"], TrainShape(2, 16, M, "bf16"), hw, resident,
                    "microbatch-outer", True, usable_budgets(hw))
    assert 0 < plan.times_s["decode"] < plan.times_s["compute"]
    lora = ModelShape.from_config(config, optim=OPTIM, lora=LORA, base_format="bf16",
                                  precision="bf16")
    assert _decode_s(lora, TrainShape(2, 16, M, "bf16"), hw, resident, True) == 0


@pytest.mark.parametrize("method", ["qlora", "lora"])
def test_adapter_records_whether_its_base_was_nf4(method, tmp_path):
    """RUN_DIR/adapter says whether its base was NF4, with the block sizes and the weights, in
    tierlm_adapter.json beside peft's files: peft loads the adapter as before, warning about no
    key it does not know (an extra key in adapter_config.json draws "upgrade PEFT")."""
    import json
    import warnings

    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftConfig, PeftModel

    from tierlm.finetune.lora import lora_targets, prepare_finetune

    model = tiny_model("llama_tied_gqa", layers=2)
    plain = copy.deepcopy(model)
    finetune, _ = prepare_finetune(method, model, LORA, None, seed=3)
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    out = finetune.save(tmp_path, lambda: adapters)
    notes = json.loads((out / "tierlm_adapter.json").read_text())
    assert notes["finetune"] == method
    quant = notes["base_model_quantization"]
    if method == "lora":
        assert quant is None
    else:
        assert (quant["format"], quant["block_size"], quant["double_quant"],
                quant["scale_format"], quant["scale_block_size"]) == ("nf4", 64, True, "int8", 256)
        targets = [f"{t}.weight" for t in lora_targets(plain, LORA.targets)]
        assert targets and quant["weights"] == sorted(targets)
        assert set(quant["weights"]) <= dict(plain.named_parameters()).keys()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = PeftConfig.from_pretrained(str(out))
        PeftModel.from_pretrained(plain, out)
    assert isinstance(config, PeftLoraConfig) and config.r == LORA.rank
    assert not [w for w in caught if "Unexpected keyword" in str(w.message)]

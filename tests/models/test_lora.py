"""--finetune lora: the tiered runtime (frozen base streamed from host or disk, adapters on the
device) reproduces the peft-wrapped reference trainer, leaves the base untouched, resumes bit for
bit, and writes an adapter peft loads and a merged export transformers loads."""

import copy

import pytest
import torch

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
from tierlm.config import (
    ActivationConfig,
    ConfigError,
    LoraConfig,
    NotSupportedYet,
    check_supported,
    from_dict,
)
from tierlm.data import train_bpe_tokenizer
from tierlm.finetune.lora import apply_lora
from tierlm.memory.tiers import Tier
from tierlm.models import build_model
from tierlm.models.testing import tiny_hf_configs
from tierlm.runtime import Engine, EngineOptions, build_engine
from tierlm.runtime.reference import ReferenceStep

CPU = torch.device("cpu")
STEPS, M, CLIP = 5, 2, 0.05
LORA = LoraConfig(rank=4, alpha=8.0)
TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in
                 range(300))


def _lora_model(name: str) -> torch.nn.Module:
    model = tiny_model(name, layers=2)
    apply_lora(model, LORA, seed=3)
    return model


@pytest.fixture(scope="module")
def reference():
    """Per model: the wrapped model before training, the batches, the reference's records,
    adapters and base after training."""
    out = {}
    for name in ("llama_tied_gqa", "gpt2"):
        base = _lora_model(name)
        steps = batches(STEPS, M)
        lrs = [OPTIM.lr * (1 - 0.1 * i) for i in range(STEPS)]
        model = copy.deepcopy(base)
        ref = ReferenceStep(model, OPTIM, grad_clip=CLIP, device=CPU)
        recs = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not p.requires_grad}
        out[name] = (base, steps, lrs, recs, ref.weights(), frozen)
    return out


def _engine(model, tmp_path, policy, order, activations=None) -> Engine:
    return new_engine(model, tmp_path / "offload", policy=policy, microbatch_order=order,
                      grad_clip=CLIP, micro_batches=M, activations=activations)


@pytest.mark.parametrize(("name", "policy", "order", "acts"), [
    ("llama_tied_gqa", "host", "microbatch-outer", None),
    ("llama_tied_gqa", "host", "layer-outer", None),
    ("llama_tied_gqa", "disk", "microbatch-outer", None),
    ("llama_tied_gqa", "disk", "layer-outer", None),
    # kept graphs over a streamed base: its saved views come back from the backward's copy
    ("llama_tied_gqa", "host", "layer-outer", "block.0=offload,block.1=selective,embed=keep"),
    ("gpt2", "disk", "layer-outer", None),
])
def test_tiered_lora_matches_the_peft_reference(reference, name, policy, order, acts, tmp_path):
    base, steps, lrs, ref_recs, ref_adapters, ref_frozen = reference[name]
    model = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng = _engine(model, tmp_path, policy, order,
                  acts and ActivationConfig(policy="full", overrides=acts))
    assert all(not p.resident and p.state_tier.value == policy for p in eng.report.placements)
    # the base holds no gradient and no optimizer state; the adapters live on the device
    assert all(st.grad is None and not st.slots and st.frozen for st in eng.states)
    assert {t.tier.value for t in eng.trainable} == {"device"}
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    assert all(r["grad_norm"] > CLIP for r in recs)  # clipping is active on every step
    adapters, frozen = eng.weights(), eng.frozen_weights()
    eng.close()
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert adapters.keys() == ref_adapters.keys() and all("lora_" in k for k in adapters)
    for k, v in ref_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= 1e-6, k
    # training moved the adapters (B starts at zero) and left the base bitwise as it was
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)
    assert frozen.keys() == before.keys() == ref_frozen.keys()
    assert all(torch.equal(frozen[k], before[k]) and torch.equal(ref_frozen[k], before[k])
               for k in before)


def test_wrapping_raises_no_deprecation_warning_from_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing`; every LoRA run printed
    that FutureWarning, which says nothing the user can act on."""
    import warnings

    model = tiny_model("llama_tied_gqa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, LORA, seed=0)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_unbuilt_combinations_are_refused():
    # built: tests/models/test_qlora.py
    check_supported(from_dict({"train": {"finetune": "qlora"}}))
    for method in ("lora", "qlora"):
        with pytest.raises(NotSupportedYet, match=rf"--finetune {method} with --nproc"):
            check_supported(from_dict({"train": {"finetune": method},
                                       "distributed": {"nproc": 2}}))
    # LoRA computes in fp32 or bf16 as auto or the user says; auto's fp8 becomes bf16 (saying
    # why), a named fp8 is refused naming the flag
    from tierlm.precision.choice import PrecisionChoice, finetune_precision
    for method in ("lora", "qlora"):
        cfg = from_dict({"train": {"finetune": method}})
        got = finetune_precision(cfg, PrecisionChoice("fp8", "RTX 4090 (sm_89) has fp8 units"))
        assert got.mode == "bf16" and got.why.startswith("RTX 4090 (sm_89) has fp8 units; ")
        assert f"--finetune {method} has no fp8" in got.why
        with pytest.raises(NotSupportedYet,
                           match=rf"--finetune {method} with --precision fp8.*--precision bf16"):
            finetune_precision(cfg, PrecisionChoice("fp8"))
        for mode, why in (("bf16", None), ("bf16", "A100 computes bf16"), ("fp32", None),
                          ("fp32", "device cpu")):
            assert finetune_precision(cfg, PrecisionChoice(mode, why)) == PrecisionChoice(
                mode, why)
    assert finetune_precision(from_dict({}), PrecisionChoice("fp8")).mode == "fp8"
    # an fp8-only flag that auto's fp8 would have read is refused once LoRA takes bf16
    emulate = from_dict({"train": {"finetune": "lora"}, "precision": {"fp8_emulate": True}})
    with pytest.raises(ConfigError, match=r"--fp8-emulate has no effect under --finetune lora"):
        finetune_precision(emulate, PrecisionChoice("fp8", "--fp8-emulate on device cpu"))
    with pytest.raises(ConfigError, match=r"--lora.targets 'nothing' matches no linear"):
        apply_lora(tiny_model("llama_tied_gqa"), LoraConfig(targets="nothing"), seed=0)
    with pytest.raises(ConfigError, match=r"--lora.rank: must be > 0"):
        from_dict({"lora": {"rank": 0}})
    with pytest.raises(ConfigError, match=r"--lora.targets: '\(' is not a regex"):
        from_dict({"lora": {"targets": "("}})


# bf16 against the bf16 reference: the adapters, their gradient norms and the base came out
# bitwise equal when written; the loss differs in its last bit (the runtime sums micro-batch
# losses in float64, the reference in an fp32 tensor): 2.4e-7 absolute on ~5.7
BF16_LOSS_REL = 1e-6


@pytest.mark.parametrize(("policy", "order", "acts"), [
    ("host", "microbatch-outer", None),
    # kept, offloaded and selective graphs over a streamed bf16 base: the stored bf16 views a
    # graph saves come back from the backward's copy
    ("disk", "layer-outer", "block.0=offload,block.1=selective,embed=keep"),
])
def test_tiered_lora_under_bf16_matches_peft_in_bf16(policy, order, acts, tmp_path):
    """--finetune lora --precision bf16: the base held, streamed and read as bf16 (its compute
    copy alone, no fp32 master), the adapters fp32 with fp32 AdamW state, every matmul under
    the bf16 policy; equal to peft in plain PyTorch doing the same bf16 computation."""
    from tierlm.precision.linear import PrecisionLinear
    from tierlm.precision.streaming import ComputeFormat

    base = bf16_model(_lora_model("llama_tied_gqa"))
    lora_q = base.model.layers[0].self_attn.q_proj  # peft's layer, its three linears swapped
    assert all(isinstance(m, PrecisionLinear) and m.compute.name == "bf16" for m in (
        lora_q.base_layer, lora_q.lora_A["default"], lora_q.lora_B["default"]))
    steps, lrs = batches(3, M), [OPTIM.lr * (1 - 0.1 * i) for i in range(3)]
    ref_recs, ref_adapters, ref_frozen = bf16_lora_reference(base, steps, lrs, CLIP)
    opts = EngineOptions(policy=policy, microbatch_order=order, grad_clip=CLIP, micro_batches=M,
                         batch_size=2, seq_len=16, offload_dir=str(tmp_path / "offload"),
                         autocast=bf16_autocast, base_format="bf16",
                         activations=acts and ActivationConfig(policy="full", overrides=acts))
    eng = build_engine(copy.deepcopy(base), OPTIM, opts, device=CPU)
    blocks = eng.states[1:-1]
    # each block's base is its bf16 compute copy and nothing else; embed and head stay fp32
    assert all(isinstance(st.compute_format, ComputeFormat) and st.master is None
               and st.frozen for st in blocks)
    assert all(st.compute_format is None for st in (eng.states[0], eng.states[-1]))
    for st in blocks:
        kinds = dict(zip([s.name for s in st.layout.slots], st.compute_format.kinds,
                         strict=True))
        assert {k for n, k in kinds.items() if n.endswith(".base_layer.weight")} == {"bf16"}
        assert {k for n, k in kinds.items() if "layernorm" in n} == {"fp32"}
        assert st.compute_format.nbytes < 2.2 * st.numel
    assert all(t.master.dtype == torch.float32 and t.tier == Tier.DEVICE
               and {s.dtype for s in t.state.values()} == {torch.float32} for t in eng.trainable)
    tier = Tier(policy)
    held = eng.ledger.tier_bytes(tier)
    before = eng.frozen_weights()
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    assert eng.ledger.tier_bytes(tier) == held
    adapters, after = eng.weights(), eng.frozen_weights()
    eng.close()
    for r, ref in zip(recs, ref_recs, strict=True):
        assert r["loss"] == pytest.approx(ref["loss"], rel=BF16_LOSS_REL)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert adapters.keys() == ref_adapters.keys()
    for k, v in ref_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= 1e-6, k
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)
    # the base: the reference's bf16 values bit for bit, unchanged by training
    assert before.keys() == after.keys() == ref_frozen.keys()
    assert all(torch.equal(before[k], ref_frozen[k]) and torch.equal(after[k], before[k])
               for k in before)


def test_planner_counts_the_bf16_base(tmp_path):
    """The planner's replay of a bf16 LoRA step (the blocks' base as bf16 compute copies on
    device, disk and resident host tiers) predicts the ledger's device peak, disk bytes and
    moves exactly."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime.shapes import ModelShape, TrainShape

    model = bf16_model(_lora_model("llama_tied_gqa"))
    plain = tiny_model("llama_tied_gqa", layers=2).config
    shape = ModelShape.from_config(plain, optim=OPTIM, lora=LORA, base_format="bf16",
                                   precision="bf16")
    fp32 = ModelShape.from_config(plain, optim=OPTIM, lora=LORA)
    assert shape.base_bytes[0] is None and shape.base_bytes[-1] is None
    assert all(b < 0.6 * 4 * n for b, n in zip(shape.base_bytes[1:-1], shape.numels[1:-1],
                                               strict=True))
    placements = [SegmentPlacement(True, Tier.DEVICE), SegmentPlacement(False, Tier.DISK),
                  SegmentPlacement(True, Tier.HOST), SegmentPlacement(False, Tier.HOST)]
    hw = PROFILES["cpu"]
    train = TrainShape(2, 16, M, "bf16")
    predicted = evaluate(shape, train, hw, placements, "microbatch-outer", True,
                         usable_budgets(hw))
    eng = new_engine(model, tmp_path, policy="auto", placements=placements,
                     microbatch_order="microbatch-outer", micro_batches=M,
                     autocast=bf16_autocast, base_format="bf16")
    assert [st.device_nbytes() for st in eng.states] == [
        4 * n if b is None else b for n, b in zip(shape.numels, shape.base_bytes, strict=True)]
    steps_match_the_plan(eng, predicted, M)
    eng.close()
    # against the fp32 base: less on the device and on disk, less crossing to the device
    base32 = evaluate(fp32, TrainShape(2, 16, M, "fp32"), hw, placements, "microbatch-outer",
                      True, usable_budgets(hw))
    assert predicted.device_peak_bytes < base32.device_peak_bytes
    assert predicted.disk_bytes < base32.disk_bytes
    assert predicted.moved_bytes["h2d"] < base32.moved_bytes["h2d"]


def _run_cfg(tmp_path, out, policy, **train):
    return from_dict({
        "model": {"path": str(tmp_path / "src")},
        "data": {"train": str(tmp_path / "corpus.txt"), "seq_len": 16},
        "train": {"finetune": "lora", "max_steps": 4, "batch_size": 2, "grad_accum_steps": 2,
                  "eval_batches": 1, "eval_every": 0, "sample_tokens": 0, **train},
        "lora": {"rank": 4, "alpha": 8.0},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "memory": {"offload_policy": policy},
        "run": {"out": str(tmp_path / out), "device": "cpu", "seed": 5},
    })


def test_bf16_run_reference_trainer_equals_runtime_and_writes_the_adapter(tmp_path):
    """`tierlm train --finetune lora --precision bf16`: the reference trainer (its base in RAM
    stored as bf16) and the runtime (host base) train the same adapters bit for bit, and the
    run writes RUN_DIR/adapter for peft's layers under the precision policy."""
    from tierlm.train.trainer import Trainer

    src = tmp_path / "src"
    build_model(tiny_hf_configs(vocab_size=300)["llama_tied_gqa"], seed=0).save_pretrained(src)
    train_bpe_tokenizer([TEXT], vocab_size=300).save_pretrained(src)
    (tmp_path / "corpus.txt").write_text(TEXT)
    adapters = {}
    for policy in ("none", "host"):
        cfg = _run_cfg(tmp_path, policy, policy, max_steps=2, grad_accum_steps=1)
        cfg.precision.mode = "bf16"
        trainer = Trainer(cfg, log=lambda _m: None)
        if policy == "none":
            base = trainer.model.model.layers[0].self_attn.q_proj.base_layer.weight
            assert base.dtype == torch.bfloat16 and not base.requires_grad
        trainer.train()
        adapters[policy] = trainer.stepper.weights()
        trainer.stepper.close()
        assert (tmp_path / policy / "adapter" / "adapter_model.safetensors").is_file()
    assert adapters["none"].keys() == adapters["host"].keys()
    assert all(torch.equal(adapters["none"][k], adapters["host"][k]) for k in adapters["none"])
    assert any(v.abs().max() > 0 for k, v in adapters["host"].items() if "lora_B" in k)


@pytest.mark.parametrize("policy", ["none", "host"])  # the reference trainer; the runtime
def test_run_writes_a_peft_adapter_and_a_merged_export_and_resumes_exactly(policy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tierlm.checkpoint import export_hf_from_checkpoint
    from tierlm.train.trainer import Trainer

    src = tmp_path / "src"
    build_model(tiny_hf_configs(vocab_size=300)["llama_tied_gqa"], seed=0).save_pretrained(src)
    train_bpe_tokenizer([TEXT], vocab_size=300).save_pretrained(src)
    (tmp_path / "corpus.txt").write_text(TEXT)

    trainer = Trainer(_run_cfg(tmp_path, "a", policy, save_every=2), log=lambda _m: None)
    result = trainer.train()
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    trained = trainer.stepper.next_token_logits(ids)
    adapters = trainer.stepper.weights()
    trainer.stepper.close()
    assert all("lora_" in k for k in adapters)

    # checkpoints hold the adapters and their optimizer state only
    from tierlm.checkpoint import load_checkpoint

    weights, optim, state = load_checkpoint(result.final_checkpoint)
    assert set(weights) == set(adapters) and state["step"] == 4
    assert all(k.split(".lora_")[0] and "lora_" in k for k in optim)

    # RUN_DIR/adapter loads with peft on the base and gives the trained logits
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src),
                                           tmp_path / "a" / "adapter").eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits[0, -1]
    assert (got - trained).abs().max().item() <= 1e-5

    # the export merges the adapters into the base: plain transformers gives the same logits
    hf = export_hf_from_checkpoint(result.final_checkpoint, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        assert (merged(input_ids=ids).logits[0, -1] - trained).abs().max().item() <= 1e-5

    # stopped at step 2 and resumed (the base reloaded from --model): the same adapters, bitwise
    first = Trainer(_run_cfg(tmp_path, "b", policy, save_every=2), log=lambda _m: None)
    first.train(until_step=2)
    first.stepper.close()
    cfg = _run_cfg(tmp_path, "b", policy, save_every=2)
    cfg.run.resume = str(tmp_path / "b")
    second = Trainer(cfg, log=lambda _m: None)
    second.train()
    resumed = second.stepper.weights()
    second.stepper.close()
    assert resumed.keys() == adapters.keys()
    assert all(torch.equal(resumed[k], adapters[k]) for k in adapters)


@pytest.mark.parametrize(("spec", "order"), [("host", "layer-outer"),
                                             ("mixed", "microbatch-outer")])
def test_planner_counts_the_frozen_base(spec, order, tmp_path):
    """The planner's replay of a LoRA step (the base master-only, no gradient landing, the
    adapters on the device) predicts the ledger's device peak, disk bytes and moves exactly."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.memory.tiers import Tier
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime.shapes import ModelShape, TrainShape

    model = _lora_model("llama_tied_gqa")
    shape = ModelShape.from_config(copy.deepcopy(model.config), optim=OPTIM, lora=LORA)
    n = len(shape.names)
    placements = ([SegmentPlacement(False, Tier.HOST)] * n if spec == "host" else
                  [SegmentPlacement(True, Tier.DEVICE)] + [SegmentPlacement(False, Tier.DISK)]
                  * (n - 2) + [SegmentPlacement(True, Tier.HOST)])
    hw = PROFILES["cpu"]
    predicted = evaluate(shape, TrainShape(2, 16, M, "fp32"), hw, placements, order, True,
                         usable_budgets(hw))
    eng = new_engine(model, tmp_path, policy="auto", placements=placements,
                     microbatch_order=order, micro_batches=M)
    moved = steps_match_the_plan(eng, predicted, M)
    assert "d2h" not in moved  # no gradient of the base leaves the device
    from tierlm.monitor.step_trace import placement_map

    held = [seg["bytes"] for seg in placement_map(eng)]  # the trace's per-segment table
    assert all(set(b.get(t, {})) <= {"master", "compute"} for b in held for t in ("host", "disk"))
    assert sum(b.get("device", {}).get("optim_state", 0) for b in held) == 8 * shape.trained_numel
    eng.close()

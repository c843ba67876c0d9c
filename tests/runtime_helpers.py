"""Shared helpers for runtime tests: the plain-PyTorch reference loop and tiny models."""

from __future__ import annotations

import copy
import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tierlm.config import OptimConfig
from tierlm.models.testing import tiny_hf_configs
from tierlm.runtime import Engine, EngineOptions, build_engine

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)
VOCAB = 300
CPU = torch.device("cpu")


def tiny_model(name: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    if name == "llama_untied":
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        )
    else:
        cfg = copy.deepcopy(tiny_hf_configs(vocab_size=VOCAB)[name])
        if hasattr(cfg, "n_layer"):
            cfg.n_layer = layers
        else:
            cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def batches(steps: int, m: int, b: int = 2, t: int = 16, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (b, t + 1), generator=g) for _ in range(m)]
            for _ in range(steps)]


def new_engine(model: torch.nn.Module, offload_dir=None, *, optim: OptimConfig = OPTIM,
               device=CPU, **options) -> Engine:
    """The tests' one engine factory: `build_engine` of `model` on the CPU with the reference's
    optimizer (OPTIM), sized for what `batches` makes (2 x 16 tokens) unless `options` say
    otherwise. `offload_dir`: where the host and disk tiers' files go (the conftest fixture
    `make_engine` puts them under the test's tmp_path); `options`: EngineOptions fields by name,
    and build_engine's `store` and `initial_weights`."""
    build = {k: options.pop(k) for k in ("store", "initial_weights") if k in options}
    opts = EngineOptions(offload_dir=None if offload_dir is None else str(offload_dir),
                         **{"batch_size": 2, "seq_len": 16, **options})
    return build_engine(model, optim, opts, device=device, **build)


def reference_run(model, steps, lrs, clip: float):
    """The reference trainer's step (tierlm.runtime.reference.ReferenceStep) on the same batches."""
    from tierlm.runtime.reference import ReferenceStep

    ref = ReferenceStep(model, OPTIM, grad_clip=clip, device=torch.device("cpu"))
    out = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out, weights


def reference_cases(steps: int) -> dict:
    """Reference runs keyed by (model, micro-batches, clip): (base model, batches, lrs, step
    records, final weights), for the tiny tied-GQA Llama and GPT-2 at M in {1, 4}."""
    out = {}
    for name in ("llama_tied_gqa", "gpt2"):
        base = tiny_model(name, layers=3)
        for m in (1, 4):
            step_batches = batches(steps, m)
            lrs = [OPTIM.lr * (1 - 0.1 * i) for i in range(steps)]
            for clip in (0.0, 0.05):
                recs, weights = reference_run(copy.deepcopy(base), step_batches, lrs, clip)
                out[(name, m, clip)] = (base, step_batches, lrs, recs, weights)
    return out


def assert_close_run(losses, ref_losses, weights, ref_weights, *, rel=1e-6, atol=1e-6):
    for a, b in zip(losses, ref_losses, strict=True):
        assert math.isclose(a, b, rel_tol=rel), (losses, ref_losses)
    for k, v in ref_weights.items():
        diff = (weights[k] - v).abs().max().item()
        assert diff <= atol, f"{k}: max abs diff {diff}"


def assert_same_state(state: dict, ref_state: dict, where: object = None) -> None:
    """Optimizer state under the reference's keys and shapes, each tensor within 1e-6 of it
    (relative to its largest value, at least 1): either runtime resumes the other's."""
    assert state.keys() == ref_state.keys(), where
    for k, v in ref_state.items():
        assert state[k].shape == v.shape, k
        assert (state[k].float() - v.float()).abs().max().item() <= 1e-6 * max(
            1.0, v.float().abs().max().item()), k


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def bf16_model(model, fp32_layers: str | None = None):
    """`model` with the bf16 precision policy applied (a peft model's layers swapped too;
    `fp32_layers`: --fp32-layers)."""
    from tierlm.config import PrecisionConfig
    from tierlm.precision import prepare_precision

    prepare_precision(model, PrecisionConfig(mode="bf16", fp32_layers=fp32_layers), "bf16",
                      torch.device("cpu"), log=lambda _m: None)
    return model


def bf16_lora_reference(base, steps, lrs, clip: float, *, nf4: bool = False):
    """peft's LoRA model `base` (under the bf16 precision policy) trained in plain PyTorch: the
    base stored in bf16 where its layers compute in bf16 (under `nf4` its NF4 round trip, then
    bf16), bf16 autocast. Its step records, adapters and frozen weights (as fp32)."""
    from tierlm.finetune.lora import store_frozen_as_computed
    from tierlm.precision.nf4 import quantise_in_place
    from tierlm.runtime.reference import ReferenceStep

    model = copy.deepcopy(base)
    if nf4:
        quantise_in_place(model)
    assert store_frozen_as_computed(model) > 0
    assert {p.dtype for n, p in model.named_parameters() if ".base_layer.weight" in n} == {
        torch.bfloat16}
    ref = ReferenceStep(model, OPTIM, grad_clip=clip, device=torch.device("cpu"),
                        autocast=bf16_autocast)
    recs = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    frozen = {n: p.detach().float() for n, p in model.named_parameters() if not p.requires_grad}
    return recs, ref.weights(), frozen


def steps_match_the_plan(eng, predicted, m: int) -> dict[str, int]:
    """Two steps of `eng`: the ledger's device peak, disk bytes and second step's bytes per link
    equal the plan's; returns that step's moved bytes by link name."""
    from tierlm.memory import Tier

    led = eng.ledger
    moved = []
    for b in batches(2, m):
        before = dict(led.total_moved_bytes)
        eng.step(b, 1e-3)
        moved.append({k.value: v - before.get(k, 0) for k, v in led.total_moved_bytes.items()
                      if v - before.get(k, 0)})
    assert led.peak_tier_bytes[Tier.DEVICE] == predicted.device_peak_bytes
    assert led.tier_bytes(Tier.DISK) == predicted.disk_bytes
    assert moved[1] == {k: v for k, v in predicted.moved_bytes.items() if v}
    return moved[1]


class InfGrad:
    """Forward hook that makes the gradient at a module's output infinite while armed (fault
    injection: the step must be skipped)."""

    armed = False

    def __call__(self, module, args, out):
        if out.requires_grad and self.armed:
            out.register_hook(lambda g: g * float("inf"))
        return out


def count_forwards(eng) -> dict[str, int]:
    """Wrap every segment's forward (the head's too) with a call counter."""
    calls: dict[str, int] = {}
    for st in eng.states:
        seg, forward = st.seg, st.seg.forward
        calls[seg.name] = 0

        def counted(*args, _name=seg.name, _forward=forward, **kw):
            calls[_name] += 1
            return _forward(*args, **kw)

        seg.forward = counted
    return calls

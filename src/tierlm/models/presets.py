"""Llama-architecture size presets and model construction.

Every preset is a plain dict of ``LlamaConfig`` kwargs so callers can inspect or tweak it before
building; ``preset_config`` turns one into a config, ``build_model`` into a module.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

# Settings shared by every preset. Untied embeddings because the tokenizer we train decides the
# vocab and the large presets follow Llama-2, which never tied; sdpa because it is the fastest
# attention that needs no extra package on both CPU and GPU. RoPE is left at the library default
# (plain RoPE, theta 10000) because the kwarg spelling changed between transformers 4 and 5.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "attn_implementation": "sdpa",
}


def _llama(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    return {
        **_COMMON,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Test-sized; GQA on purpose so the smallest model exercises the kv-head broadcast path.
    "tiny": _llama(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        max_position_embeddings=2048,
    ),
    # Demo default: ~20M params, trains at a usable speed on two CPU cores.
    "small": _llama(
        vocab_size=8192,
        hidden_size=384,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=6,
        intermediate_size=1024,
        max_position_embeddings=2048,
    ),
    "125m": _llama(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        max_position_embeddings=4096,
    ),
    "350m": _llama(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=2816,
        max_position_embeddings=4096,
    ),
    # TinyLlama-1.1B shape.
    "1b": _llama(
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        max_position_embeddings=4096,
    ),
    "3b": _llama(
        vocab_size=32000,
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
        max_position_embeddings=4096,
    ),
    # Llama-2-7B shape (6,738,415,616 params).
    "7b": _llama(
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
    ),
    # Llama-2-13B shape.
    "13b": _llama(
        vocab_size=32000,
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        max_position_embeddings=4096,
    ),
}


def preset_config(
    size: str, *, vocab_size: int | None = None, max_seq_len: int | None = None
) -> PretrainedConfig:
    """Return a fresh ``LlamaConfig`` for preset ``size``.

    ``vocab_size`` replaces the preset's (the trained tokenizer decides it). ``max_seq_len`` only
    ever raises ``max_position_embeddings``: with default RoPE the limit is advisory and costs no
    parameters, so a shorter training context keeps the preset's longer limit.
    """
    if size not in PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose one of: {', '.join(PRESETS)}")
    kwargs = copy.deepcopy(PRESETS[size])
    if vocab_size is not None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        kwargs["vocab_size"] = vocab_size
    if max_seq_len is not None:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        kwargs["max_position_embeddings"] = max(kwargs["max_position_embeddings"], max_seq_len)
    return LlamaConfig(**kwargs)


def build_model(
    config: PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> PreTrainedModel:
    """Build a randomly initialised causal LM from ``config`` directly on ``device``.

    On ``"meta"`` nothing is allocated, so any preset can be inspected (shapes, parameter counts)
    in well under a second. The config is copied first because ``from_config`` writes the chosen
    attention implementation back into the config it is given, which would leak into any other
    model built from the same object.
    """
    if seed is not None:
        # Seeds the CPU and every CUDA generator, so a given (seed, device) pair is reproducible.
        torch.manual_seed(seed)
    config = copy.deepcopy(config)
    # Allocating under the device context avoids a full-size CPU copy before a move to the GPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model


def count_params(model: torch.nn.Module) -> int:
    """Number of unique parameters; a tied embedding/LM-head matrix counts once."""
    # ``parameters()`` already skips repeated Parameter objects, which is what tying produces.
    return sum(p.numel() for p in model.parameters())


def param_count_for(config: PretrainedConfig) -> int:
    """Parameter count of the model ``config`` describes, without allocating it."""
    return count_params(build_model(config, device="meta"))

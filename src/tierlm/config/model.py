"""Sections `model` and `lora`: which model to train, and its low-rank adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Every block's attention and MLP projections: Llama family and GPT-2 module names.
LORA_DEFAULT_TARGETS = (
    r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_attn|c_proj|c_fc)"
)
MODEL_SIZES = ("tiny", "small", "125m", "350m", "1b", "3b", "7b", "13b")


@dataclass(kw_only=True)
class ModelConfig:
    size: Literal["tiny", "small", "125m", "350m", "1b", "3b", "7b", "13b"] = "small"
    """Llama-architecture size preset, used when no `path` is given (--model-size)."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors + tokenizer) to
    continue training from; Llama, Qwen2/Qwen3, Mistral and GPT-2 families (--model)."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model directory (auto_map); off unless
    you trust its source (--trust-remote-code)."""



@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 16
    """Rank r of each adapter: lora_A is (r, in), lora_B is (out, r) (--lora.rank)."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B A x to the frozen layer's output
    (--lora.alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's lora_dropout); > 0 makes a run depend on the
    random stream, as any dropout does (--lora.dropout)."""
    targets: str = LORA_DEFAULT_TARGETS
    """Regex over module names (re.fullmatch, as peft's target_modules) of the linear layers
    that get adapters; the default: every block's attention and MLP projections of the Llama
    family (q/k/v/o, gate/up/down) and GPT-2 (c_attn, c_proj, c_fc) (--lora.targets)."""


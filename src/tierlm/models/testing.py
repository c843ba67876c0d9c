"""Tiny Hugging Face configs shared by tests that need real (non-preset) architectures."""

from __future__ import annotations

from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen2Config


def tiny_hf_configs(vocab_size: int = 300) -> dict[str, PretrainedConfig]:
    """Three ~100k-parameter causal LMs that cover the checkpoint shapes we must round-trip.

    - ``llama_tied_gqa``: tied embeddings plus grouped-query attention (4 query, 2 kv heads).
    - ``qwen2``: tied embeddings, GQA, and q/k/v biases (the one bias-carrying family).
    - ``gpt2``: tied embeddings, learned positions, fused qkv ``Conv1D`` weights.

    Dropout is zero everywhere so train-mode forwards are deterministic, and special-token ids
    sit inside the small vocab (GPT-2's default 50256 would not).
    """
    last_token_id = vocab_size - 1
    return {
        "llama_tied_gqa": LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=last_token_id,
        ),
        "qwen2": Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=last_token_id,
        ),
        "gpt2": GPT2Config(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=last_token_id,
        ),
    }

"""Streamed checkpoint loading (tierlm.models.load): the tiered runtime reads a safetensors
directory segment by segment into a meta-device skeleton and must end up with exactly the fp32
weights and buffers `from_pretrained(dtype=torch.float32)` gives."""

import copy
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

from tests.runtime_helpers import VOCAB, batches, new_engine
from tierlm.models import ModelLoadError, hf_model_skeleton
from tierlm.models.load import CheckpointWeights
from tierlm.models.testing import tiny_hf_configs


def _configs() -> dict:
    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                 bos_token_id=0, eos_token_id=VOCAB - 1)
    return {
        **tiny_hf_configs(vocab_size=VOCAB),  # llama_tied_gqa, qwen2 (biases), gpt2
        "llama_untied": LlamaConfig(**small, tie_word_embeddings=False),
        "mistral": MistralConfig(**small, sliding_window=8, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**small, head_dim=16, tie_word_embeddings=True),
    }


def _save(name: str, path, *, dtype=torch.bfloat16, max_shard_size=None, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(_configs()[name]),
                                             attn_implementation="sdpa")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(path, **kwargs)
    return path


def _streamed_engine(path, offload_dir, policy="host"):
    skeleton = hf_model_skeleton(path)
    source = CheckpointWeights(path, skeleton)
    engine = new_engine(skeleton, offload_dir, policy=policy, initial_weights=source)
    return engine, skeleton, source


def _from_pretrained(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="sdpa")


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", list(_configs()))
def test_streamed_weights_equal_from_pretrained(name, sharded, tmp_path):
    path = _save(name, tmp_path / "ckpt", max_shard_size="40KB" if sharded else None)
    index = path / "model.safetensors.index.json"
    if sharded:
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 2
    else:
        assert not index.exists()
    engine, skeleton, source = _streamed_engine(path, tmp_path / "off")
    ref = _from_pretrained(path)
    weights = engine.weights()
    expected = dict(ref.named_parameters())
    assert sorted(weights) == sorted(expected)
    for n, p in expected.items():
        assert weights[n].dtype == torch.float32
        assert torch.equal(weights[n], p), n  # bit for bit: bf16 -> fp32 is exact
    ref_buffers = dict(ref.named_buffers())
    buffers = dict(skeleton.named_buffers())
    assert sorted(buffers) == sorted(ref_buffers)
    for n, b in ref_buffers.items():
        assert buffers[n].device.type == "cpu" and torch.equal(buffers[n], b), n
    assert source.unexpected == []
    if ref.config.tie_word_embeddings:
        assert "lm_head.weight" not in weights  # one tensor, owned by the embedding


def test_gpt2_keys_without_prefix_and_buffers_load_as_transformers(tmp_path):
    """Original GPT-2 checkpoints store `h.0...` for `transformer.h.0...`, no lm_head (tied),
    and the causal-mask buffers `attn.bias`/`attn.masked_bias` the model no longer has."""
    path = _save("gpt2", tmp_path / "saved", dtype=torch.float16)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    n_pos = _configs()["gpt2"].n_positions
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n_pos, n_pos)).view(1, 1, n_pos, n_pos)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors.pop("lm_head.weight", None)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, old / "model.safetensors", metadata={"format": "pt"})

    engine, _, source = _streamed_engine(old, tmp_path / "off")
    ref = _from_pretrained(old)
    weights = engine.weights()
    assert sorted(weights) == sorted(n for n, _ in ref.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(weights[n], p), n
    # attn.bias is on the model's ignore list; transformers reports masked_bias, so do we
    assert source.unexpected == ["h.0.attn.masked_bias", "h.1.attn.masked_bias"]


def _resave(path, change):
    """Rewrite the single-file checkpoint at `path` with `change(tensors)` applied."""
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_a_clear_error(tmp_path):
    path = _save("llama_untied", tmp_path / "ckpt")
    _resave(path, lambda t: t.pop("lm_head.weight"))  # untied: the head has no other source
    with pytest.raises(ModelLoadError, match=r"parameter 'lm_head.weight' \(shape \(300, 64\)\) "
                                             r"is not in the checkpoint"):
        CheckpointWeights(path, hf_model_skeleton(path))


def test_wrong_shape_is_a_clear_error(tmp_path):
    path = _save("qwen2", tmp_path / "ckpt")
    key = "model.layers.1.self_attn.k_proj.bias"
    _resave(path, lambda t: t.update({key: t[key][:8].clone()}))
    with pytest.raises(ModelLoadError, match=rf"tensor '{key}' \(model.safetensors\) has shape "
                                             r"\(8,\) \(BF16\), but .* has shape \(32,\)"):
        CheckpointWeights(path, hf_model_skeleton(path))


def test_missing_shard_is_a_clear_error(tmp_path):
    path = _save("llama_tied_gqa", tmp_path / "ckpt", max_shard_size="40KB")
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match=r"names shard 'model-00002-of-.*', which is missing"):
        CheckpointWeights(path, hf_model_skeleton(path))


@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_disk_run_from_streamed_load_equals_materialised(name, tmp_path):
    """Two steps on the disk tier: the engine built from the streamed loader and the one built
    from the materialised from_pretrained model give the same losses and weights, bit for
    bit."""
    path = _save(name, tmp_path / "ckpt", max_shard_size="40KB")
    steps = batches(2, 2)
    runs = []
    for streamed in (True, False):
        if streamed:
            engine, _, _ = _streamed_engine(path, tmp_path / "off-streamed", policy="disk")
        else:
            engine = new_engine(_from_pretrained(path).train(), tmp_path / "off-ref",
                                policy="disk")
        losses = [engine.step(b, 1e-2)["loss"] for b in steps]
        runs.append((losses, engine.weights()))
        engine.close()
    (losses, weights), (ref_losses, ref_weights) = runs
    assert all(math.isfinite(x) for x in losses)
    assert losses == ref_losses
    for n, w in ref_weights.items():
        assert torch.equal(weights[n], w), n


def test_cli_train_from_a_checkpoint_on_the_disk_tier_streams_it(tmp_path, capsys, monkeypatch):
    """`tierlm train --model DIR --offload-policy disk` builds a skeleton, streams the weights,
    trains, and its default end of run (export, sample) still works."""
    import tierlm.train.prepare
    from tierlm.cli import main
    from tierlm.data import train_bpe_tokenizer

    def materialised(*args, **kwargs):
        raise AssertionError("the tiered runtime must not materialise the checkpoint")

    monkeypatch.setattr(tierlm.train.prepare, "load_hf_model", materialised)
    text = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}."
                     for i in range(300))
    path = _save("llama_tied_gqa", tmp_path / "ckpt", max_shard_size="40KB")
    train_bpe_tokenizer([text], vocab_size=VOCAB).save_pretrained(path)
    data = tmp_path / "corpus.txt"
    data.write_text(text)
    out = tmp_path / "run"
    rc = main(["train", "--model", str(path), "--data", str(data), "--out", str(out),
               "--device", "cpu", "--offload-policy", "disk", "--max-steps", "2",
               "--data.seq_len", "32", "--train.batch_size", "2", "--train.sample_tokens", "4"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "offload policy disk" in printed and "sample: " in printed
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert exported.get_input_embeddings().weight is exported.get_output_embeddings().weight


def test_runtime_from_a_preset_initialises_one_segment_at_a_time(tmp_path):
    """The engine built from a preset skeleton holds the weights build_model gives, and while
    it is built at most one segment's initial weights are alive: each segment's tensors are
    dropped once packed, before the next is drawn."""
    import weakref

    from tierlm.models import build_model, preset_config
    from tierlm.models.init import preset_skeleton

    config = preset_config("tiny")
    skeleton, source = preset_skeleton(config, seed=3)
    live: list[weakref.ref] = []
    peak_bytes = 0
    segment_bytes = []

    def counted(seg):
        nonlocal peak_bytes
        values = source(seg)
        held = sum(t.nbytes for t in (r() for r in live) if t is not None)
        segment_bytes.append(sum(t.nbytes for t in values.values()))
        peak_bytes = max(peak_bytes, held + segment_bytes[-1])
        live.extend(weakref.ref(t) for t in values.values())
        return values

    engine = new_engine(skeleton, tmp_path / "a", policy="disk", initial_weights=counted)
    ref = new_engine(build_model(config, seed=3), tmp_path / "b", policy="disk")
    try:
        assert len(segment_bytes) == len(engine.states)
        assert peak_bytes == max(segment_bytes)  # one segment, never two
        assert peak_bytes < sum(segment_bytes) / 2
        ref_weights = ref.weights()
        for n, w in engine.weights().items():
            assert torch.equal(w, ref_weights[n]), n
        steps = batches(1, 2, t=8)
        losses = [engine.step([b % config.vocab_size for b in s], 1e-2)["loss"] for s in steps]
        ref_losses = [ref.step([b % config.vocab_size for b in s], 1e-2)["loss"] for s in steps]
        assert losses == ref_losses
    finally:
        engine.close()
        ref.close()

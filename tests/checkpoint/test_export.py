"""Streamed Hugging Face export: shards and index, dtypes, ties, atomicity, the run and the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tierlm.checkpoint import TrainState, export_hf_from_checkpoint, save_checkpoint
from tierlm.cli import main
from tierlm.config import from_dict
from tierlm.data import train_bpe_tokenizer
from tierlm.models import build_model
from tierlm.models import export as export_mod
from tierlm.models.testing import tiny_hf_configs
from tierlm.train import run_training

SHARD_BYTES = 64 << 10  # several shards for the ~100k-parameter models
TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in
                 range(300))


def _checkpoint(tmp_path: Path, name: str, source_dtype: str | None = None):
    """A checkpoint of a tiny `name` model with random (not initial) weights, as a run
    writes it: parameters by name, tied ones once."""
    model = build_model(tiny_hf_configs()[name], seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = TrainState(step=1, sampler={"epoch": 0, "index": 0}, run_config={},
                       source_dtype=source_dtype)
    ckpt = save_checkpoint(tmp_path / "run", weights=weights, optimizer_state={},
                           model_config=model.config, tokenizer=None, state=state)
    return model.eval(), weights, ckpt


def _stored(out: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of an export by name: (file, tensor)."""
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            assert st.metadata() == {"format": "pt"}
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert k not in found
                found[k] = (f.name, st.get_tensor(k))
    return found


def _logits(model, seed=1):
    x = torch.randint(0, model.config.vocab_size, (2, 16),
                      generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits.float()


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])  # tied GQA with q/k/v biases; GPT-2
def test_sharded_fp32_export_round_trips(name, tmp_path):
    model, weights, ckpt = _checkpoint(tmp_path, name)
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf", dtype="float32",
                                    max_shard_bytes=SHARD_BYTES)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = _stored(out)
    assert index["weight_map"] == {k: f for k, (f, _) in stored.items()}
    assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in stored.values())
    for shard in shards:  # about max_shard_bytes each: only a lone larger tensor goes over
        names = [k for k, (f, _) in stored.items() if f == shard]
        assert len(names) == 1 or sum(stored[k][1].nbytes for k in names) <= SHARD_BYTES
    assert "lm_head.weight" not in stored  # tied: stored once, as save_pretrained does
    assert set(stored) == set(weights)
    for k, w in weights.items():
        assert torch.equal(stored[k][1], w), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert reloaded.get_input_embeddings().weight is reloaded.get_output_embeddings().weight
    assert (_logits(reloaded) - _logits(model)).abs().max().item() < 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporaries


@pytest.mark.parametrize(("name", "dtype"), [("qwen2", "bfloat16"), ("gpt2", "bfloat16"),
                                           ("qwen2", "float16")])
def test_half_export_is_the_exact_cast(name, dtype, tmp_path):
    _, weights, ckpt = _checkpoint(tmp_path, name)
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf", dtype=dtype,
                                    max_shard_bytes=SHARD_BYTES)
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # the dtype config.json records
    params = dict(reloaded.named_parameters())
    assert {p.dtype for p in params.values()} == {getattr(torch, dtype)}
    for k, w in weights.items():
        assert torch.equal(params[k].detach(), w.to(getattr(torch, dtype))), k
    sizes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert sizes < sum(w.nbytes for w in weights.values()) * 0.6  # half of fp32, plus headers


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    _, weights, ckpt = _checkpoint(tmp_path, "qwen2")
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert set(_stored(out)) == set(weights)


@pytest.mark.parametrize("source, expected", [("bfloat16", "bfloat16"), (None, "float32")])
def test_auto_dtype_is_the_dtype_the_run_started_from(source, expected, tmp_path):
    _, _, ckpt = _checkpoint(tmp_path, "gpt2", source_dtype=source)
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == expected
    assert {t.dtype for _, t in _stored(out).values()} == {getattr(torch, expected)}


def test_checkpoint_without_a_recorded_dtype_takes_its_runs_model_dtype(tmp_path):
    src = tmp_path / "src"
    build_model(tiny_hf_configs()["gpt2"], seed=0, dtype=torch.float16).save_pretrained(src)
    model = build_model(tiny_hf_configs()["gpt2"], seed=0)
    state = TrainState(step=1, sampler={}, run_config={"model": {"path": str(src)}})
    ckpt = save_checkpoint(tmp_path / "run", weights=dict(model.named_parameters()),
                           model_config=model.config, tokenizer=None, state=state)
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf")
    assert {t.dtype for _, t in _stored(out).values()} == {torch.float16}


def test_run_from_a_bf16_checkpoint_exports_bf16(tmp_path):
    """A run from a bf16 Hugging Face directory trains in fp32 and exports bf16 (RUN_DIR/hf and
    `tierlm export`), with its generation_config.json; --export-dtype float32 overrides; a
    preset run (here on the tiered runtime) exports fp32."""
    src = tmp_path / "src"
    build_model(tiny_hf_configs()["qwen2"], seed=0, dtype=torch.bfloat16).save_pretrained(src)
    train_bpe_tokenizer([TEXT], vocab_size=300).save_pretrained(src)
    (tmp_path / "corpus.txt").write_text(TEXT)
    (src / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 299, "do_sample": True, "temperature": 0.7}))
    base = {
        "model": {"path": str(src)},
        "data": {"train": str(tmp_path / "corpus.txt"), "seq_len": 32},
        "train": {"max_steps": 2, "batch_size": 2, "eval_batches": 1, "eval_every": 0,
                  "sample_tokens": 4},
        "run": {"out": str(tmp_path / "run"), "device": "cpu"},
    }
    from tierlm.train.preflight import Preflight

    def export_need(cfg):  # the disk space checked before the run, for the export
        return Preflight(cfg, tmp_path, n_params=1000, device_is_cpu=True,
                         start_rss_bytes=0).export_estimate_bytes()

    assert export_need(from_dict(base)) == 2000
    assert export_need(from_dict({**base, "run": {"export_dtype": "float32"}})) == 4000
    result = run_training(from_dict(base), log=lambda _m: None)
    hf = tmp_path / "run" / "hf"
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for _, t in _stored(hf).values()} == {torch.bfloat16}
    assert (hf / "tokenizer.json").is_file()
    assert json.loads((hf / "generation_config.json").read_text())["temperature"] == 0.7
    final = {k: v for k, v in _stored(hf).items()}

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "cli")]) == 0
    cli = _stored(tmp_path / "cli")
    assert cli.keys() == final.keys()
    assert all(torch.equal(cli[k][1], final[k][1]) for k in cli)
    assert main(["export", str(result.final_checkpoint), str(tmp_path / "cli32"),
                 "--export-dtype", "float32"]) == 0
    assert {t.dtype for _, t in _stored(tmp_path / "cli32").values()} == {torch.float32}

    # a preset, trained by the tiered runtime: float32
    preset = {**base, "model": {"size": "tiny"}, "run": {"out": str(tmp_path / "p"),
                                                         "device": "cpu"},
              "data": {**base["data"], "vocab_size": 300},
              "memory": {"offload_policy": "host"}}
    run_training(from_dict({**preset, "train": {**base["train"], "max_steps": 1}}),
                 log=lambda _m: None)
    assert json.loads((tmp_path / "p" / "hf" / "config.json").read_text())["dtype"] == "float32"


def test_export_dtype_float16_flag_on_a_run_and_on_tierlm_export(tmp_path):
    """`--export-dtype float16`: a training run's RUN_DIR/hf and `tierlm export` write float16
    safetensors, each tensor the cast of the checkpoint's fp32 weights (whose config says
    float32: a preset run)."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    assert main(["train", "--model-size", "tiny", "--data", str(tmp_path / "corpus.txt"),
                 "--data.vocab_size", "300", "--seq-len", "16", "--batch-size", "2",
                 "--max-steps", "1", "--eval-every", "0", "--train.eval_batches", "1",
                 "--train.sample_tokens", "0", "--device", "cpu", "--out", str(tmp_path / "run"),
                 "--export-dtype", "float16"]) == 0
    from tierlm.checkpoint import list_checkpoints, load_checkpoint

    weights, _, _ = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    assert {weights[k].dtype for k in weights} == {torch.float32}
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "cli"),
                 "--export-dtype", "float16"]) == 0
    for out in (tmp_path / "run" / "hf", tmp_path / "cli"):
        assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
        stored = _stored(out)
        assert set(stored) == set(weights)
        for k in weights:
            assert stored[k][1].dtype == torch.float16
            assert torch.equal(stored[k][1], weights[k].to(torch.float16)), k


def test_failed_export_leaves_no_half_written_dir(tmp_path, monkeypatch):
    _, _, ckpt = _checkpoint(tmp_path, "qwen2")
    real = export_mod._write_shard
    calls = []

    def failing(path, tensors, dtype, *progress):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, tensors, dtype, *progress)

    monkeypatch.setattr(export_mod, "_write_shard", failing)
    with pytest.raises(OSError):
        export_hf_from_checkpoint(ckpt, tmp_path / "hf", max_shard_bytes=SHARD_BYTES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hf, no temporaries

    (tmp_path / "hf").mkdir()  # an earlier export stays whole
    (tmp_path / "hf" / "model.safetensors").write_text("earlier")
    calls.clear()
    with pytest.raises(OSError):
        export_hf_from_checkpoint(ckpt, tmp_path / "hf", max_shard_bytes=SHARD_BYTES)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model.safetensors"]
    assert (tmp_path / "hf" / "model.safetensors").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


def test_export_killed_between_shards_publishes_nothing(tmp_path):
    _, _, ckpt = _checkpoint(tmp_path, "qwen2")
    code = ("import sys; from pathlib import Path; "
            "from tierlm.checkpoint import export_hf_from_checkpoint as e; "
            f"e(Path(sys.argv[1]), Path(sys.argv[2]), max_shard_bytes={SHARD_BYTES})")
    env = {**os.environ, "TIERLM_CRASH_AT": "export-shard:2",
           "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt), str(tmp_path / "hf")],
                          env=env, capture_output=True, timeout=900)  # a hang guard
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "hf").exists()


def test_tied_config_with_a_different_head_is_refused(tmp_path):
    model = build_model(tiny_hf_configs()["qwen2"], seed=0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    state = TrainState(step=1, sampler={}, run_config={})
    ckpt = save_checkpoint(tmp_path / "run", weights=weights, model_config=model.config,
                           tokenizer=None, state=state)
    # the name check comes first: a tied model has no lm_head parameter of its own
    from tierlm.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="unexpected \\['lm_head.weight'\\]"):
        export_hf_from_checkpoint(ckpt, tmp_path / "hf")
    sources = {t.name: t for t in export_mod.module_tensors(model)}
    head = export_mod.SourceTensor("lm_head.weight", tuple(weights["lm_head.weight"].shape),
                                   torch.float32, lambda n: iter([weights["lm_head.weight"]]))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        export_mod.write_hf_model(tmp_path / "hf", [*sources.values(), head],
                                  config=model.config.to_dict(), dtype=torch.float32)
    assert not (tmp_path / "hf").exists()


def test_export_help_lists_the_dtype_flag(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "--export-dtype" in text and "bfloat16" in text

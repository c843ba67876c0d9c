"""The reference trainer: resume exactness, metrics, skipped steps, end-to-end CLI runs."""

import json
import math
from pathlib import Path

import pytest
import torch

from tierlm.checkpoint import CheckpointError, latest_valid_checkpoint, list_checkpoints
from tierlm.cli import main
from tierlm.config import from_dict
from tierlm.monitor.metrics import read_metrics
from tierlm.runtime import Engine
from tierlm.runtime.reference import ReferenceStep
from tierlm.train import Trainer
from tierlm.train.schedule import lr_at


def tiny_cfg(out, **train):
    base = {"max_steps": 10, "batch_size": 4, "eval_every": 0, "eval_batches": 1}
    base.update(train)
    return from_dict(
        {
            "model": {"size": "tiny"},
            "data": {"seq_len": 32, "vocab_size": 512},
            "optim": {"lr": 3e-3, "warmup_steps": 2},
            "train": base,
            "run": {"out": str(out), "device": "cpu", "seed": 3},
        }
    )


def quiet(_msg):
    pass


def checkpointing_on(model) -> bool:
    """transformers >= 5 names it activation checkpointing (the old name warns)."""
    on = getattr(type(model), "is_activation_checkpointing", None)
    return bool(model.is_activation_checkpointing if on is not None
                else model.is_gradient_checkpointing)


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_reproduces_uninterrupted_losses_exactly(tmp_path):
    straight = Trainer(tiny_cfg(tmp_path / "a", grad_accum_steps=2), log=quiet)
    full = straight.train()

    first = Trainer(tiny_cfg(tmp_path / "b", grad_accum_steps=2), log=quiet)
    part1 = first.train(until_step=5)
    del first
    resumed_cfg = tiny_cfg(tmp_path / "b", grad_accum_steps=2)
    resumed_cfg.run.resume = str(tmp_path / "b")
    second = Trainer(resumed_cfg, log=quiet)
    assert second.step == 5
    part2 = second.train()

    assert part1.losses + part2.losses == full.losses  # bitwise, fp32 on CPU
    a, b = state_of(straight.model), state_of(second.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 11))  # nothing lost, nothing duplicated


def test_metrics_jsonl_has_required_fields(tmp_path):
    t = Trainer(tiny_cfg(tmp_path, max_steps=4, eval_every=2), log=quiet)
    t.train()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
    assert train[0]["lr"] == pytest.approx(lr_at(0, t.cfg.optim, 4))


def test_non_finite_gradient_skips_the_step_bitwise(tmp_path):
    t = Trainer(tiny_cfg(tmp_path, max_steps=3), log=quiet)
    t.train_step()
    before = state_of(t.model)
    ref = t.stepper
    opt_before = {k: v.clone() for k, v in ref.optimizer.state[ref.params[0]].items()}
    victim = ref.params[0]
    handle = victim.register_hook(lambda g: torch.full_like(g, float("inf")))
    rec = t.train_step()
    handle.remove()
    assert rec["skipped"] and t.skipped_steps == 1
    after = state_of(t.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for k, v in ref.optimizer.state[victim].items():
        assert torch.equal(v, opt_before[k])
    assert not t.train_step()["skipped"]


def test_lr_schedule_warmup_then_cosine():
    cfg = from_dict({"optim": {"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1}}).optim
    lrs = [lr_at(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lr_at(20, cfg, 20) == pytest.approx(0.1)


def test_corrupt_checkpoint_falls_back_loudly(tmp_path):
    t = Trainer(tiny_cfg(tmp_path, max_steps=4, save_every=2), log=quiet)
    t.train()
    ckpts = list_checkpoints(tmp_path)
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    f = ckpts[-1] / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    warnings = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append) == ckpts[0]
    assert "model.safetensors fails its checksum" in warnings[0]
    g = ckpts[0] / "optimizer.safetensors"
    g.write_bytes(g.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="every checkpoint failed"):
        latest_valid_checkpoint(tmp_path, warn=quiet)


def test_cli_train_end_to_end_then_export(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--config", "configs/tiny.yaml", "--out", str(out), "--device", "cpu"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "held-out perplexity" in text and str(out) in text
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_ppl" in r]
    assert evals[-1]["eval_ppl"] < evals[0]["eval_ppl"]

    from transformers import AutoModelForCausalLM

    exported = tmp_path / "exported"
    assert main(["export", str(out), str(exported)]) == 0
    a = AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="sdpa")
    b = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa")
    x = torch.randint(0, a.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)


def test_resumed_run_summarises_perplexity_from_where_it_resumed(tmp_path):
    """The closing perplexity line of a resumed run starts at the last evaluation of the run it
    continues, not at its own final step ("1017.55 at step 5 -> 1017.55 at step 5")."""
    from tierlm.train.run import run_training

    run_training(tiny_cfg(tmp_path, max_steps=2, sample_tokens=0), log=quiet)
    evals = {r["step"]: r["eval_ppl"] for r in read_metrics(tmp_path / "metrics.jsonl")
             if "eval_ppl" in r}
    cfg = tiny_cfg(tmp_path, max_steps=3, sample_tokens=0)
    cfg.run.resume = str(tmp_path)
    logged: list[str] = []
    result = run_training(cfg, log=logged.append)
    assert logged[-1] == (f"held-out perplexity: {evals[2]:.2f} at step 2 -> "
                          f"{result.eval_ppl[3]:.2f} at step 3")


def test_prediction_lines_do_not_call_an_empty_tier_a_misprediction():
    """A tier the plan leaves empty and the run too read "(0.00x)"; a ratio needs a
    prediction."""
    from tierlm.plan.predictions import prediction_lines

    MiB = 2**20
    rec = {"predicted_device_peak_bytes": 4 * MiB, "measured_device_peak_bytes": 3 * MiB,
           "predicted_host_peak_bytes": 0, "measured_host_peak_bytes": 0}
    assert prediction_lines(rec) == [
        "peak device bytes: predicted 4.0 MiB, measured 3.0 MiB (0.75x)",
        "peak host bytes: predicted 0.0 MiB, measured 0.0 MiB (as planned)"]
    rec["measured_host_peak_bytes"] = MiB
    assert prediction_lines(rec)[1].endswith("measured 1.0 MiB (none planned)")
    del rec["measured_host_peak_bytes"]  # the reference trainer has no ledger
    assert len(prediction_lines(rec)) == 1


def test_default_precision_is_auto_and_runs_fp32_on_cpu(tmp_path):
    import yaml

    from tierlm.config import Config

    cfg = tiny_cfg(tmp_path, max_steps=1)
    assert cfg.precision.mode == "auto" == Config().precision.mode
    logged: list[str] = []
    t = Trainer(cfg, log=logged.append)
    assert t.precision == "fp32" and t.cfg.precision.mode == "fp32"
    assert logged[0] == "precision: auto -> fp32 (device cpu: no fp8 units, no native bf16)"
    assert not any(type(m).__name__ == "PrecisionLinear"
                   for m in t.model.modules())  # fp32: the model is left as built
    with t.stepper.autocast() as ctx:  # no autocast: fp32 matmuls
        assert ctx is None
    saved = (tmp_path / "config.yaml").read_text()
    assert saved.startswith("# precision: auto -> fp32 (")  # the run says what auto chose
    assert yaml.safe_load(saved)["precision"]["mode"] == "fp32"  # and resumes with it
    t.stepper.close()


def test_fp8_only_flag_under_auto_names_the_flag(tmp_path):
    from tierlm.config import ConfigError

    cfg = tiny_cfg(tmp_path, max_steps=1)
    cfg.precision.fp8_history = 4
    with pytest.raises(ConfigError, match=r"--fp8-history has no effect: --precision auto "
                       r"resolved to fp32 here \(device cpu.*\); add --precision fp8"):
        Trainer(cfg, log=quiet)


def test_bf16_autocast_and_full_checkpointing_train(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=3)
    cfg.precision.mode = "bf16"
    cfg.activations.policy = "full"
    t = Trainer(cfg, log=quiet)
    with t.stepper.autocast() as ctx:  # the settings reached the step, not just the config
        assert ctx.fast_dtype == torch.bfloat16
    assert checkpointing_on(t.model)
    result = t.train()
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)


def test_full_checkpointing_is_lossless(tmp_path):
    plain = Trainer(tiny_cfg(tmp_path / "a", max_steps=3), log=quiet)
    cfg = tiny_cfg(tmp_path / "b", max_steps=3)
    cfg.activations.policy = "full"
    ckpt = Trainer(cfg, log=quiet)
    # otherwise both runs are the same configuration
    assert checkpointing_on(ckpt.model) and not checkpointing_on(plain.model)
    assert ckpt.train().losses == pytest.approx(plain.train().losses, rel=1e-6)


def test_resume_without_checkpoints_is_a_clear_error(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps({"model": {"size": "tiny"}}))
    assert main(["train", "--resume", str(run)]) == 2
    assert "no checkpoints" in capsys.readouterr().err


def test_train_large_model_entry_point_forwards_flags():
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "train_large_model.py"), "--backend", "fsdp",
         "--grad-checkpointing", "full"],
        capture_output=True, text=True, cwd=root,
    )
    assert proc.returncode == 2
    assert "not supported yet: --grad-checkpointing full with --backend fsdp" in proc.stderr


@pytest.mark.parametrize("policy", ["host", "disk"])
def test_tiered_runtime_trains_like_the_reference_and_resumes(policy, tmp_path):
    """The trainer on the tiered runtime reproduces the reference trainer's losses, evaluation
    and final weights, and a run interrupted at step 3 resumes to the same result."""
    ref = Trainer(tiny_cfg(tmp_path / "ref", max_steps=6, grad_accum_steps=2, eval_every=3),
                  log=quiet)
    ref_result = ref.train()

    def tiered_cfg(out):
        cfg = tiny_cfg(out, max_steps=6, grad_accum_steps=2, eval_every=3)
        cfg.memory.offload_policy = policy
        return cfg

    first = Trainer(tiered_cfg(tmp_path / "t"), log=quiet)
    part1 = first.train(until_step=3)
    first.stepper.close()
    cfg = tiered_cfg(tmp_path / "t")
    cfg.run.resume = str(tmp_path / "t")
    second = Trainer(cfg, log=quiet)
    assert second.step == 3 and isinstance(second.stepper, Engine)
    part2 = second.train()
    losses = part1.losses + part2.losses
    assert losses == pytest.approx(ref_result.losses, rel=1e-6)
    evals = {**part1.eval_ppl, **part2.eval_ppl}
    assert evals == pytest.approx(ref_result.eval_ppl, rel=1e-6)
    w = second.stepper.weights()
    for name, p in ref.model.named_parameters():
        assert (w[name] - p.detach()).abs().max().item() <= 1e-6
    recs = read_metrics(tmp_path / "t" / "metrics.jsonl")
    step_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in step_recs] == list(range(1, 7))
    assert all(r["h2d_bytes"] > 0 and "device_peak_bytes" in r for r in step_recs)
    if policy == "disk":
        assert all(r["disk_read_bytes"] > 0 for r in step_recs)
    second.stepper.close()


def test_reference_checkpoint_resumes_on_the_tiered_runtime(tmp_path):
    """Checkpoints are keyed by parameter name, so a run can move to the disk tier mid-way."""
    straight = Trainer(tiny_cfg(tmp_path / "a", max_steps=6), log=quiet).train()
    first = Trainer(tiny_cfg(tmp_path / "b", max_steps=6), log=quiet)
    part1 = first.train(until_step=3)
    cfg = tiny_cfg(tmp_path / "b", max_steps=6)
    cfg.run.resume = str(tmp_path / "b")
    cfg.memory.offload_policy = "disk"
    second = Trainer(cfg, log=quiet)
    assert isinstance(first.stepper, ReferenceStep) and isinstance(second.stepper, Engine)
    assert second.step == 3
    part2 = second.train()
    assert part1.losses + part2.losses == pytest.approx(straight.losses, rel=1e-6)
    second.stepper.close()


def test_cli_trains_on_the_disk_tier_and_exports(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main([
        "train", "--config", "configs/tiny.yaml", "--out", str(out), "--device", "cpu",
        "--offload-policy", "disk", "--max-steps", "6", "--eval-every", "3",
    ])
    assert rc == 0
    text = capsys.readouterr().out
    assert "offload policy disk" in text
    assert "measured over 6 steps: disk writes:" in text  # the run's SSD-wear projection
    assert (out / "hf" / "model.safetensors").is_file()
    # the disk tier's files are working state: gone at a normal end, and the run says so
    assert not (out / "offload").exists() and f"deleted its working files in {out}" in text
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.num_hidden_layers == 2


def test_impossible_budget_is_refused_before_training(tmp_path, capsys):
    rc = main([
        "train", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "r"), "--device", "cpu",
        "--offload-policy", "host", "--device-budget", "10KiB",
    ])
    assert rc == 2
    err = capsys.readouterr().err
    assert "device needs" in err and "--device-budget is 10.0 KiB" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("runtime", ["reference", "disk"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_every_precision_completes_the_default_end_of_run(precision, runtime, tmp_path, capsys):
    """Evaluation, checkpoint, export and the default sample, under each compute precision: the
    sample once ran outside the run's autocast, so bf16 layers met fp32 ones and it crashed."""
    out = tmp_path / "run"
    args = ["train", "--config", "configs/tiny.yaml", "--out", str(out), "--device", "cpu",
            "--max-steps", "1", "--precision", precision, "--train.eval_batches", "1"]
    if precision == "fp8":
        args.append("--fp8-emulate")  # no fp8 units on the CPU
    if runtime == "disk":
        args += ["--offload-policy", "disk"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"precision: {precision}" in text or precision == "fp32"
    sample = next(line for line in text.splitlines() if line.startswith("sample: "))
    assert len(sample) > len("sample: ")  # the default sample ran and produced text
    assert (out / "hf" / "config.json").is_file()


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _chat_data(tmp_path) -> tuple[Path, Path]:
    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for i in range(60):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]}) + "\n")
    template = tmp_path / "chat.jinja"
    template.write_text(_CHAT_TEMPLATE)
    return path, template


@pytest.mark.parametrize("packing", ["stream", "off", "documents"])
def test_chat_data_trains_on_assistant_tokens_on_both_runtimes(tmp_path, packing):
    path, template = _chat_data(tmp_path)
    logs, recs = [], {}
    for policy in ("none", "host"):
        cfg = tiny_cfg(tmp_path / policy, max_steps=3, eval_every=0)
        cfg.data.train, cfg.data.chat_template, cfg.data.packing = str(path), str(template), packing
        cfg.memory.offload_policy = policy
        trainer = Trainer(cfg, log=logs.append)
        assert isinstance(trainer.stepper, Engine) == (policy == "host")
        checkpoint = trainer.train().final_checkpoint
        recs[policy] = [r for r in read_metrics(tmp_path / policy / "metrics.jsonl")
                        if "loss_tokens" in r]
    text = "\n".join(logs)
    assert "chat, training on assistant tokens; template: " in text and "[[" in text
    # the template travels with the checkpoint's (and so the export's) tokenizer
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == _CHAT_TEMPLATE
    full = 4 * 32  # batch x seq_len: every target of a plain-text step
    for ref, eng in zip(recs["none"], recs["host"], strict=True):
        assert 0 < ref["loss_tokens"] < full and ref["loss_tokens"] == eng["loss_tokens"]
        # tokens/s counts every token a step processes; trained tokens/s those with a loss
        assert ref["tokens_per_s"] == pytest.approx(full / ref["step_time_s"])
        assert ref["trained_tokens_per_s"] == pytest.approx(
            ref["loss_tokens"] / ref["step_time_s"])
        assert math.isfinite(ref["loss"]) and ref["loss"] == pytest.approx(eng["loss"], rel=1e-4)


def test_plain_text_data_reports_every_target_as_loss_tokens(tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path, max_steps=1), log=quiet)
    rec = trainer.train_step()
    assert rec["loss_tokens"] == trainer.tokens_per_step == 4 * 32

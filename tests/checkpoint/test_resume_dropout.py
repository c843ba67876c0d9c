"""Resume reproduces runs that draw random numbers (dropout): the RNG state a checkpoint stores
is restored, on the reference trainer and on the tiered runtime (recompute included), and
through a SIGKILL. Every other resume test trains without dropout, so none of them would notice
a resume that skipped the RNG state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.checkpoint.test_kill import (
    ROOT,
    _final_state,
    _log_of,
    _resumed_at,
    _trained_past,
    _wait,
)
from tierlm.config import from_dict
from tierlm.data import train_bpe_tokenizer
from tierlm.models import build_model
from tierlm.models.testing import tiny_hf_configs
from tierlm.train import Trainer

TEXT = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in
                 range(300))
STEPS, STOP = 4, 2


def gpt2_with_dropout():
    """A tiny GPT-2 with GPT-2's own dropout (0.1 on embeddings, attention and residuals)."""
    config = tiny_hf_configs(vocab_size=300)["gpt2"]
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1
    return config


def write_model(src, config):
    build_model(config, seed=0).save_pretrained(src)
    train_bpe_tokenizer([TEXT], vocab_size=300).save_pretrained(src)


def run_cfg(tmp_path, out, policy, *, lora: bool, recompute: str = "none"):
    train = {"max_steps": STEPS, "batch_size": 2, "grad_accum_steps": 2, "eval_batches": 1,
             "eval_every": 0, "sample_tokens": 0, "save_every": STOP}
    extra = {}
    if lora:
        train["finetune"] = "lora"
        extra["lora"] = {"rank": 4, "alpha": 8.0, "dropout": 0.1}
    return from_dict({
        "model": {"path": str(tmp_path / "src")},
        "data": {"train": str(tmp_path / "corpus.txt"), "seq_len": 16},
        "train": train,
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "memory": {"offload_policy": policy},
        "activations": {"policy": recompute},
        "run": {"out": str(tmp_path / out), "device": "cpu", "seed": 5},
        **extra,
    })


def quiet(_msg):
    pass


CASES = [
    pytest.param("none", False, "none", id="gpt2-reference"),
    pytest.param("host", False, "full", id="gpt2-runtime-recompute"),
    pytest.param("none", True, "none", id="lora-reference"),
    pytest.param("disk", True, "none", id="lora-runtime"),
]


@pytest.mark.parametrize(("policy", "lora", "recompute"), CASES)
def test_resume_with_dropout_reproduces_the_uninterrupted_losses(policy, lora, recompute,
                                                                  tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    config = tiny_hf_configs(vocab_size=300)["llama_tied_gqa"] if lora else gpt2_with_dropout()
    write_model(tmp_path / "src", config)

    straight = Trainer(run_cfg(tmp_path, "a", policy, lora=lora, recompute=recompute), log=quiet)
    full = straight.train()
    weights = straight.stepper.weights()
    straight.stepper.close()

    first = Trainer(run_cfg(tmp_path, "b", policy, lora=lora, recompute=recompute), log=quiet)
    part1 = first.train(until_step=STOP)
    first.stepper.close()
    # what a fresh process would see: the RNG somewhere else than where the run left it
    torch.manual_seed(1234)
    cfg = run_cfg(tmp_path, "b", policy, lora=lora, recompute=recompute)
    cfg.run.resume = str(tmp_path / "b")
    second = Trainer(cfg, log=quiet)
    assert second.step == STOP
    part2 = second.train()
    resumed = second.stepper.weights()
    second.stepper.close()

    assert part1.losses + part2.losses == full.losses  # bitwise, fp32 on CPU
    assert resumed.keys() == weights.keys()
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)


def test_sigkill_then_resume_with_dropout_equals_an_uninterrupted_run(tmp_path):
    """A CLI run of GPT-2 with its dropout on the tiered runtime (recomputing every segment) is
    SIGKILLed after its first checkpoint and rerun with `--resume auto`: the loss log and the
    final weights equal an uninterrupted run's, bit for bit."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    write_model(tmp_path / "src", gpt2_with_dropout())
    steps = 6

    def launch(out, log):
        cmd = [sys.executable, "-m", "tierlm", "train", "--model", str(tmp_path / "src"),
               "--data", str(tmp_path / "corpus.txt"), "--seq-len", "16", "--batch-size", "2",
               "--grad-accum-steps", "2", "--precision", "fp32", "--max-steps", str(steps),
               "--save-every", "2", "--eval-every", "0", "--train.sample_tokens", "0",
               "--device", "cpu", "--offload-policy", "host", "--grad-checkpointing", "full",
               "--out", str(out), "--resume", "auto"]
        with log.open("a") as f:
            f.write("\n=== launch\n")
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("a"),
                                stderr=subprocess.STDOUT)

    env = {**os.environ, "TIERLM_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("TIERLM_CRASH_AT", None)
    straight, straight_log = tmp_path / "straight", tmp_path / "straight.log"
    straight_run = launch(straight, straight_log)
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = launch(out, log)
    # after step 3 the step-2 checkpoint is written: the rerun resumes mid-run
    hang_guard = time.monotonic() + 600  # a hang, not a duration: the run takes seconds
    while not _trained_past(out, 2) and proc.poll() is None:
        assert time.monotonic() < hang_guard, log.read_text()[-4000:]
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert _wait(proc, log) == -signal.SIGKILL, log.read_text()[-4000:]
    assert _wait(launch(out, log), log) == 0, log.read_text()[-4000:]
    assert _resumed_at(log) in (2, 4), log.read_text()[-4000:]
    assert _wait(straight_run, straight_log) == 0, straight_log.read_text()[-4000:]

    assert _log_of(out) == _log_of(straight)
    assert [r["step"] for r in _log_of(out) if "loss" in r] == list(range(1, steps + 1))
    w1, _, _ = _final_state(straight)
    w2, _, _ = _final_state(out)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_tiered_runtime_with_dropout_trains_and_evaluates_like_the_reference(tmp_path):
    """The same dropout masks in both (the runtime's recompute replays them), and the held-out
    loss without dropout in both (the runtime evaluated in training mode: dropout on held-out
    data, and draws from the training stream that changed every later mask)."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    write_model(tmp_path / "src", gpt2_with_dropout())
    results = {}
    for policy, recompute in (("none", "none"), ("host", "full")):
        cfg = run_cfg(tmp_path, policy, policy, lora=False, recompute=recompute)
        cfg.train.eval_every = 2
        trainer = Trainer(cfg, log=quiet)
        results[policy] = trainer.train()
        trainer.stepper.close()
    ref, tiered = results["none"], results["host"]
    assert tiered.losses == pytest.approx(ref.losses, rel=1e-6)
    assert sorted(tiered.eval_ppl) == sorted(ref.eval_ppl) == [0, 2, 4]
    assert tiered.eval_ppl == pytest.approx(ref.eval_ppl, rel=1e-6)

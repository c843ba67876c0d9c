"""`tierlm train --nproc 2` end to end: torchrun, 2 gloo ranks, top-k sync, rank-0 outputs,
checkpoints with the ranks' residuals, and a resume that continues with the same losses."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys

import torch
import yaml

from tierlm.checkpoint import load_checkpoint


def _train(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tierlm", "train", *args]
    # the timeout guards against a hang only (the runs take seconds to a minute)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _text(path, n_words: int, seed: int) -> str:
    """A small corpus: the test is about processes, not about Shakespeare."""
    rng = random.Random(seed)
    words = ["the", "king", "queen", "sword", "night", "crown", "speaks", "falls", "and", "of"]
    path.write_text(" ".join(rng.choice(words) for _ in range(n_words)) + "\n")
    return str(path)


def _steps(run) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if "loss" in r]
    assert len(steps) == len(set(steps)), "two ranks wrote metrics"
    return {r["step"]: r for r in recs if "loss" in r}


def test_nproc_two_trains_with_topk_and_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    data = ["--data", _text(tmp_path / "train.txt", 20000, 0),
            "--eval-data", _text(tmp_path / "eval.txt", 2000, 1)]
    out = _train([*data,
        "--nproc", "2", "--model-size", "tiny", "--seq-len", "32", "--batch-size", "2",
        "--max-steps", "4", "--save-every", "2", "--eval-every", "0",
        "--train.eval_batches", "2", "--train.sample_tokens", "0",
        "--sparse-grad-ratio", "0.1", "--distributed.timeout_s", "120", "--out", str(run),
        "--data.vocab_size", "300",
    ])
    assert out.stdout.count("held-out perplexity:") == 1  # only rank 0 reports
    first = _steps(run)
    assert sorted(first) == [1, 2, 3, 4]
    assert all(r["net_send_bytes"] > 0 for r in first.values())
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["distributed"]["nproc"] == 2
    assert (run / "hf" / "config.json").is_file()
    _, optim, state = load_checkpoint(run / "checkpoints" / "step_00000004")
    assert int(optim["dp.world_size"]) == 2
    for r in (0, 1):
        assert any(k.startswith(f"dp.rank{r}.residual.") for k in optim)

    # Continue from step 2 (the saved config relaunches 2 processes): the same losses follow.
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    again = _train(["--resume", str(run)])
    # a restart from step 0 would log the same losses too: the run must say where it resumed
    assert re.search(r"resumed from \S*step_00000002 at step 2\b", again.stdout), again.stdout
    resumed = _steps(run)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step]["loss"] == first[step]["loss"], step


def test_fsdp_backend_trains_in_one_process_and_exports(tmp_path):
    """FSDP2 over a one-rank group (CPU offload, gloo): the trainer's loop, dcp checkpoints,
    `--resume auto` from them and the Hugging Face export work with the sharded model."""
    import pytest

    from tierlm.checkpoint import CheckpointError
    from tierlm.config import resolve
    from tierlm.train import run_training
    from tierlm.train.trainer import Trainer

    run = tmp_path / "run"
    flags = {
        "data.train": _text(tmp_path / "train.txt", 6000, 0),
        "data.eval": _text(tmp_path / "eval.txt", 1500, 1),
        "data.vocab_size": 300, "data.seq_len": 32, "model.size": "tiny",
        "train.batch_size": 2, "train.max_steps": 3, "train.eval_every": 0,
        "train.save_every": 2, "train.eval_batches": 1, "train.sample_tokens": 4,
        "run.out": str(run), "distributed.backend": "fsdp",
        "distributed.fsdp_cpu_offload": True,
    }
    lines: list[str] = []
    result = run_training(resolve(None, flags), log=lines.append)
    assert len(result.losses) == 3 and all(x == x for x in result.losses)
    assert (run / "hf" / "config.json").is_file()
    ckpt = result.final_checkpoint
    assert (ckpt / "__0_0.distcp").is_file() and (ckpt / ".metadata").is_file()
    assert not (ckpt / "model.safetensors").exists()  # shards, not gathered weights
    weights, optim, state = load_checkpoint(ckpt)
    assert state["tensors"] == "dcp" and state["world_size"] == 1
    assert any(k.endswith(".exp_avg") for k in optim)
    assert "lm_head.weight" in weights and "model.norm.weight" in weights  # full, by name
    assert weights["lm_head.weight"].shape[0] == 300  # assembled, not a shard

    # --resume auto from step 2 (the dcp shards) repeats step 3 exactly
    shutil.rmtree(ckpt)
    lines.clear()
    again = run_training(resolve(None, {**flags, "run.resume": "auto"}), log=lines.append)
    assert any("resumed from" in line and "step_00000002" in line for line in lines)
    assert again.losses == result.losses[2:]

    # `tierlm export` of the dcp checkpoint: the weights the run exported at its end
    from tierlm.checkpoint import SafetensorsFile
    from tierlm.cli import main

    assert main(["export", str(again.final_checkpoint), str(tmp_path / "cli_hf")]) == 0
    ours = SafetensorsFile(run / "hf" / "model.safetensors")
    theirs = SafetensorsFile(tmp_path / "cli_hf" / "model.safetensors")
    assert set(ours.entries) <= set(theirs.entries)
    for name in ours.entries:
        assert torch.equal(ours.read(name), theirs.read(name)), name

    # a run without --backend fsdp refuses the shards, naming the flag
    plain = {k: v for k, v in flags.items() if not k.startswith("distributed.")}
    with pytest.raises(CheckpointError, match="--backend fsdp"):
        Trainer(resolve(None, {**plain, "run.resume": "auto"}), log=lambda _: None)


def test_fsdp_two_ranks_start_from_rank0s_copy_of_a_hf_checkpoint(tmp_path):
    """`--backend fsdp --nproc 2 --model DIR`: rank 1 builds the model on the meta device and
    takes its shards of the weights rank 0 loaded, so the run trains as one process with the
    whole batch does from the same checkpoint."""
    data = ["--data", _text(tmp_path / "train.txt", 6000, 0),
            "--eval-data", _text(tmp_path / "eval.txt", 1500, 1)]
    common = [*data, "--seq-len", "32", "--eval-every", "0", "--train.eval_batches", "1",
              "--save-every", "0", "--distributed.timeout_s", "120"]
    # the checkpoint and the one-process run train in this process (a launch costs its imports);
    # the two ranks under test are launched as the user would
    from tierlm.cli import main

    assert main(["train", *common, "--model-size", "tiny", "--data.vocab_size", "300",
                 "--batch-size", "4", "--max-steps", "1", "--train.sample_tokens", "0",
                 "--out", str(tmp_path / "base")]) == 0
    hf = str(tmp_path / "base" / "hf")
    assert main(["train", *common, "--model", hf, "--batch-size", "4", "--max-steps", "3",
                 "--train.sample_tokens", "0", "--out", str(tmp_path / "one")]) == 0
    out = _train([*common, "--model", hf, "--batch-size", "2", "--max-steps", "3",
                  "--nproc", "2", "--backend", "fsdp", "--train.sample_tokens", "4",
                  "--out", str(tmp_path / "two")])
    assert out.stdout.count("sample:") == 1  # rank 0 samples; rank 1 only joins the gather
    one, two = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(two[step]["loss"] - one[step]["loss"]) <= 1e-5 * one[step]["loss"], step

"""The run directory: a rerun never mixes two runs, one process at a time, an unusable --out is
a one-line error, exports follow the umask, and the disk tier's files go at a normal end."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.monitor_helpers import quiet, tiny_corpus, tiny_run_cfg
from tierlm.checkpoint import list_checkpoints
from tierlm.cli import main
from tierlm.config import ConfigError
from tierlm.monitor.metrics import read_metrics

SRC = Path(__file__).parents[2] / "src"


def _argv(corpus: Path, out: Path, *extra: str, steps: int = 2) -> list[str]:
    """`tierlm train` of the tiny model on the tiny corpus: a second or two."""
    return [
        "train", "--model-size", "tiny", "--data", str(corpus), "--seq-len", "32",
        "--data.vocab_size", "300", "--batch-size", "4", "--max-steps", str(steps),
        "--eval-every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
        "--device", "cpu", "--seed", "3", "--out", str(out), *extra,
    ]


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _one_error_line(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierlm: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_rerun_into_a_run_directory_is_refused_naming_resume_and_overwrite(tmp_path, capsys):
    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    assert main(_argv(corpus, out, steps=2)) == 0
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(_argv(corpus, out, steps=1)) == 2
    _one_error_line(capsys.readouterr().err, str(out), "--resume", "--overwrite")
    assert (out / "metrics.jsonl").read_bytes() == metrics  # untouched
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]


def test_a_run_refused_before_its_first_step_can_be_rerun_with_other_flags(tmp_path, capsys):
    """A refused plan leaves config.yaml only: trying another budget needs no --overwrite."""
    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    assert main(_argv(corpus, out, "--offload-policy", "auto", "--hardware", "cpu",
                      "--device-budget", "64KiB")) == 2
    assert "no plan fits" in capsys.readouterr().err
    assert main(_argv(corpus, out, "--offload-policy", "auto", "--hardware", "cpu")) == 0


def test_overwrite_deletes_the_old_run_and_leaves_other_files(tmp_path, capsys):
    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    assert main(_argv(corpus, out, "--save-every", "1", steps=3)) == 0
    (out / "report").mkdir()  # as `tierlm report RUN_DIR` leaves it
    (out / "report" / "report.md").write_text("old run")
    (out / "notes.txt").write_text("mine")  # not the run's: kept
    capsys.readouterr()
    assert main(_argv(corpus, out, "--overwrite", steps=2)) == 0
    assert "--overwrite: deleted the previous run" in capsys.readouterr().out
    assert _steps(out) == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]
    assert not (out / "report").exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "hf" / "config.json").is_file()
    # the claim is not part of the run: resuming it later must not clear it again
    assert "overwrite: false" in (out / "config.yaml").read_text()


def test_overwrite_never_deletes_the_run_directory_through_its_offload_dir(tmp_path):
    """`--offload-dir .` (relative: the run directory itself) must not make --overwrite clear
    the whole directory."""
    from tierlm.train.rundir import clear_run

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    clear_run(tmp_path, (tmp_path / ".",))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_resume_and_resume_auto_continue_the_run(tmp_path, capsys):
    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    assert main(_argv(corpus, out, steps=2)) == 0
    assert main(["train", "--resume", str(out), "--max-steps", "3"]) == 0
    assert main(_argv(corpus, out, "--resume", "auto", steps=4)) == 0  # the same command again
    assert _steps(out) == [1, 2, 3, 4]
    assert list_checkpoints(out)[-1].name == "step_00000004"
    assert main(_argv(corpus, out, "--resume", "auto", "--overwrite", steps=4)) == 2
    _one_error_line(capsys.readouterr().err, "--overwrite", "--resume")


def test_the_interrupt_message_resumes_the_interrupted_run_not_the_old_one(
        tmp_path, capsys, monkeypatch):
    """The issue's case: a finished 3-step run, a rerun over it interrupted at step 1; the
    interrupt message's --resume continues from step 1 of the new run."""
    import re

    from tierlm.train.trainer import Trainer

    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    assert main(_argv(corpus, out, steps=3)) == 0
    step = Trainer.train_step

    def interrupted_at_step_2(self):
        if self.step == 1:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_step_2)
    capsys.readouterr()
    assert main(_argv(corpus, out, "--overwrite", steps=3)) == 130
    (resume_dir,) = re.findall(r"continue with --resume (\S+)", capsys.readouterr().out)
    monkeypatch.setattr(Trainer, "train_step", step)
    assert main(["train", "--resume", resume_dir]) == 0
    assert re.search(r"resumed from \S+step_00000001 at step 1\b", capsys.readouterr().out)
    assert _steps(out) == [1, 2, 3]


_HOLDER = """
import sys
from pathlib import Path
from tierlm.train.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_one_blocks_nothing(
        tmp_path, capsys):
    corpus, out = tiny_corpus(tmp_path), tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(_argv(corpus, out, "--resume", "auto")) == 2
        _one_error_line(capsys.readouterr().err, f"PID {holder.pid}", str(out))
        assert not (out / "config.yaml").exists()  # refused before anything was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the killed holder's lock; its file (with the dead PID) stays behind
    assert (out / ".lock").read_text().strip() == str(holder.pid)
    assert main(_argv(corpus, out, "--resume", "auto")) == 0
    assert (out / ".lock").read_text().strip() == str(os.getpid())


def test_a_lock_file_with_a_dead_pid_does_not_block(tmp_path):
    from tierlm.train.rundir import lock_run_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(f"{dead.pid}\n")
    lock = lock_run_dir(tmp_path)
    assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    lock.release()


def test_the_lock_is_shared_within_a_process_and_dropped_at_release(tmp_path):
    """Two Trainers of one process (a resume in a test) share the lock; other processes see it
    until the last holder releases it."""
    from tierlm.train.rundir import lock_run_dir

    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")

    def free() -> bool:
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path / ".lock")],
                              capture_output=True).returncode == 0

    a = lock_run_dir(tmp_path)
    b = lock_run_dir(tmp_path)
    a.release()
    assert not free()
    b.release()
    assert free()


def _regular_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "run")


@pytest.mark.parametrize("where", ["under-a-file", "a-file", "proc"])
def test_an_unusable_out_is_one_error_line_before_the_model_is_built(where, tmp_path, capsys,
                                                                     monkeypatch):
    import tierlm.train.prepare as prepare_mod
    import tierlm.train.trainer as trainer_mod

    def no_model(*_a, **_k):
        raise AssertionError("the model was built before --out was checked")

    monkeypatch.setattr(prepare_mod, "preset_config", no_model)
    under_a_file = _regular_file(tmp_path)
    out = {"under-a-file": under_a_file, "a-file": str(Path(under_a_file).parent),
           "proc": "/proc/tierlm-test/run"}[where]
    assert main(_argv(tiny_corpus(tmp_path), Path(out))) == 2
    _one_error_line(capsys.readouterr().err, f"--out {out}")
    # the trainer checks it too, for callers of the API
    with pytest.raises(ConfigError, match=f"--out {out}: (cannot create|that is a file)"):
        trainer_mod.Trainer(tiny_run_cfg(Path(out), tiny_corpus(tmp_path)), log=quiet)


def _modes(path: Path) -> set[tuple[str, int]]:
    kinds = {(("dir" if p.is_dir() else "file"), stat.S_IMODE(p.stat().st_mode))
             for p in path.rglob("*")}
    return kinds | {("dir", stat.S_IMODE(path.stat().st_mode))}


def test_exports_follow_the_umask(tmp_path):
    import torch

    from tierlm.config import LoraConfig
    from tierlm.finetune.lora import prepare_finetune
    from tierlm.models import build_model, preset_config
    from tierlm.train.run import run_training

    old = os.umask(0o022)
    try:
        run_training(tiny_run_cfg(tmp_path / "run", tiny_corpus(tmp_path), max_steps=1),
                     log=quiet)
        model = build_model(preset_config("tiny", vocab_size=300, max_seq_len=32), seed=0)
        finetune, _ = prepare_finetune("lora", model, LoraConfig(rank=2, alpha=4.0),
                                       None, seed=0)
        weights = {n: torch.zeros(p.shape) for n, p in model.named_parameters()
                   if p.requires_grad}
        finetune.save(tmp_path / "run", lambda: weights)
    finally:
        os.umask(old)
    assert _modes(tmp_path / "run" / "hf") == {("dir", 0o755), ("file", 0o644)}
    assert _modes(tmp_path / "run" / "adapter") == {("dir", 0o755), ("file", 0o644)}


def test_a_normal_end_deletes_the_disk_tier_files_and_says_so(tmp_path):
    from tierlm.train.run import run_training

    corpus = tiny_corpus(tmp_path)
    logged: list[str] = []
    run_training(tiny_run_cfg(tmp_path / "run", corpus, policy="disk", max_steps=2),
                 log=logged.append)
    assert not (tmp_path / "run" / "offload").exists()
    assert any(m.startswith(f"disk tier: deleted its working files in {tmp_path / 'run'}")
               for m in logged), logged
    # an --offload-dir elsewhere may hold other things (here: the run directory itself): only
    # the disk tier's files go
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    cfg = tiny_run_cfg(elsewhere / "run2", corpus, policy="disk", max_steps=2)
    cfg.memory.offload_dir = str(elsewhere)
    logged.clear()
    run_training(cfg, log=logged.append)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt", "run2"]
    assert (elsewhere / "run2" / "hf" / "model.safetensors").is_file()
    assert list_checkpoints(elsewhere / "run2")
    assert any(m.startswith(f"disk tier: deleted its working files in {elsewhere}")
               for m in logged), logged

"""SIGKILL at any moment loses nothing (ARCHITECTURE.md invariant 3).

A training subprocess (tiny model, fp32, CPU, every segment's state on the disk tier, a checkpoint
every 3 steps) is killed with SIGKILL five times and rerun each time with the same command line
(`--resume auto`). Two kills land at exact moments through the test-only crash points
(tierlm/crashpoints.py): between the files of a checkpoint being written, and while a disk-tier
write is in flight; three land at random times during training. The final weights, optimizer
state and loss log must equal an uninterrupted run's, bit for bit.

The moments are drawn from a seeded RNG (TIERLM_KILL_SEED to vary it; the seed is printed).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierlm.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint

ROOT = Path(__file__).parents[2]
MAX_STEPS = 30
# against a hang only, not a duration: a run takes seconds, several times that on a loaded machine
HANG_GUARD_S = 900


def _command(out: Path, data: Path) -> list[str]:
    return [
        sys.executable, "-m", "tierlm", "train", "--model-size", "tiny", "--data", str(data),
        "--seq-len", "32", "--data.vocab_size", "512", "--batch-size", "4",
        "--max-steps", str(MAX_STEPS), "--save-every", "3", "--keep-checkpoints", "2",
        "--eval-every", "5", "--train.eval_batches", "1", "--train.sample_tokens", "0",
        "--device", "cpu", "--offload-policy", "disk", "--out", str(out), "--resume", "auto",
    ]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return recs


def _trained_past(out: Path, step: int) -> bool:
    return any("loss" in r and r["step"] > step for r in _records(out))


def _launch(out: Path, data: Path, env: dict, log: Path, crash_at: str | None = None):
    env = dict(env)
    if crash_at:
        env["TIERLM_CRASH_AT"] = crash_at
    with log.open("a") as f:
        f.write(f"\n=== launch (crash at {crash_at})\n")
    return subprocess.Popen(_command(out, data), cwd=ROOT, env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path, timeout_s: float = HANG_GUARD_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"run did not finish; log:\n{log.read_text()[-4000:]}") from None


def _kill_at_random_time(out, data, env, log, rng) -> int:
    """Start a run, wait until it trained a random 1-6 steps past its last checkpoint (4-9 on a
    fresh start, so that the next run has a checkpoint to resume), then SIGKILL it after a
    further random delay (wherever in the step, eval or save it is)."""
    ckpts = list_checkpoints(out)
    resumed_at = int(ckpts[-1].name.split("_")[1]) if ckpts else 0
    target = resumed_at + rng.randint(1, 6) if ckpts else rng.randint(4, 9)
    proc = _launch(out, data, env, log)
    deadline = time.monotonic() + HANG_GUARD_S
    while not _trained_past(out, target - 1) and proc.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.05))
    proc.send_signal(signal.SIGKILL)
    return _wait(proc, log)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


def _resumed_at(log: Path) -> int | None:
    """The step the latest launch in the log resumed at, None if it did not resume."""
    last = log.read_text().rsplit("\n=== launch", 1)[-1]
    found = re.findall(r"resumed from \S+ at step (\d+)", last)
    return int(found[-1]) if found else None


def _final_state(out: Path):
    path = list_checkpoints(out)[-1]
    weights, optim, state = load_checkpoint(path)
    return ({k: weights[k] for k in weights}, {k: optim[k] for k in optim}, state["step"])


def _log_of(out: Path):
    """Everything in metrics.jsonl that is a function of the training, not of the clock."""
    keys = ("step", "loss", "lr", "grad_norm", "skipped", "eval_loss")
    return [{k: r[k] for k in keys if k in r} for r in _records(out)
            if "loss" in r or "eval_loss" in r]


def test_sigkill_at_five_moments_then_resume_equals_an_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("TIERLM_KILL_SEED", "1234"))
    rng = random.Random(seed)
    print(f"kill seed {seed}")
    data = tmp_path / "text.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog"
                              for i in range(1200)) + "\n")
    # one thread per run: the uninterrupted run trains on the other core meanwhile (both take
    # the same thread count, so their sums add in the same order)
    env = {**os.environ, "TIERLM_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("TIERLM_CRASH_AT", None)
    straight = tmp_path / "straight"
    straight_log = tmp_path / "straight.log"
    straight_run = _launch(straight, data, env, straight_log)
    log = tmp_path / "runs.log"

    out = tmp_path / "killed"
    # Crash points per run: a checkpoint of the tiny model writes 9 files (model and optimizer
    # shards of 4 segments, then the RNG); the disk tier writes 16 files at setup, 12 more when
    # a checkpoint is loaded, and 12 per step (master and both moments of 4 segments).
    moments = [
        ("time", None),
        ("checkpoint-file", rng.randint(1, 9 * 2)),  # inside this run's first or second save
        ("time", None),
        ("disk-write", rng.randint(29, 28 + 12 * 4)),  # a step's update, after the setup
        ("time", None),
    ]
    newest = None  # the checkpoint the next launch must resume from
    for kind, n in moments:
        if kind == "time":
            rc = _kill_at_random_time(out, data, env, log, rng)
        else:
            rc = _wait(_launch(out, data, env, log, crash_at=f"{kind}:{n}"), log)
        assert rc == -signal.SIGKILL, f"{kind} {n}: exit {rc}\n{log.read_text()[-4000:]}"
        assert _resumed_at(log) == (newest and _step_of(newest)), log.read_text()[-4000:]
        steps = [r["step"] for r in _records(out) if "loss" in r]
        print(f"killed at {kind} {n or ''}: trained to step {max(steps, default=0)}, "
              f"checkpoints {[p.name for p in list_checkpoints(out)]}")
        # a kill never leaves a checkpoint that fails verification behind as the newest (the
        # next run would fall back to an older one, loudly but losing steps)
        newest = list_checkpoints(out)[-1]
        verify_checkpoint(newest)
    assert _wait(_launch(out, data, env, log), log) == 0, log.read_text()[-4000:]
    assert _resumed_at(log) == _step_of(newest)
    assert _wait(straight_run, straight_log) == 0, straight_log.read_text()[-4000:]

    assert _log_of(out) == _log_of(straight)
    assert [r["step"] for r in _log_of(out) if "loss" in r] == list(range(1, MAX_STEPS + 1))
    w1, o1, s1 = _final_state(straight)
    w2, o2, s2 = _final_state(out)
    assert s1 == s2 == MAX_STEPS
    assert w1.keys() == w2.keys() and o1.keys() == o2.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert all(torch.equal(o1[k], o2[k]) for k in o1)
    assert len(list_checkpoints(out)) == 2  # --keep-checkpoints 2
    assert log.read_text().count("resumed from") == len(moments)  # every restart resumed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-q"]))

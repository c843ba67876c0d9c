"""Shared helpers for the monitoring tests: a small text corpus (so a Trainer sets up in well
under a second) and the config of a tiny run on it."""

from __future__ import annotations

import random
from pathlib import Path

from tierlm.config import Config, from_dict

WORDS = (
    "the king and queen of a small land walk by the sea to find gold while birds sing over old "
    "towers and a fool laughs at the moon"
).split()


def tiny_corpus(directory: Path) -> Path:
    path = directory / "corpus.txt"
    if not path.exists():
        rng = random.Random(0)
        lines = (" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2500))
        path.write_text("\n".join(lines), encoding="utf-8")
    return path


def tiny_run_cfg(out: Path, corpus: Path, *, policy: str = "none", **train) -> Config:
    base = {"max_steps": 6, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
            "sample_tokens": 0}
    base.update(train)
    return from_dict(
        {
            "model": {"size": "tiny"},
            "data": {"train": str(corpus), "seq_len": 32, "vocab_size": 300},
            "optim": {"lr": 3e-3, "warmup_steps": 2},
            "train": base,
            # a tiny model streams its state through the disk tier at a rate that really would
            # wear a drive out in months: a huge rating keeps disk_wear out of the other alerts'
            # tests (tests/memory/test_wear.py tests it)
            "memory": {"offload_policy": policy, "disk_endurance_tbw": 1e9},
            "run": {"out": str(out), "device": "cpu", "seed": 3},
        }
    )


def quiet(_msg: str) -> None:
    pass

"""Reliability (issue G): crash-consistent checkpoints, resume, disk space, host memory,
numerical faults and untrusted files. The SIGKILL test is tests/checkpoint/test_kill.py; the fuzz
tests are tests/test_fuzz.py."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.runtime_helpers import OPTIM, batches, new_engine, tiny_model
from tierlm.checkpoint import (
    MANIFEST,
    CheckpointError,
    TensorFiles,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    recover_checkpoints,
    save_checkpoint,
    verify_checkpoint,
    write_safetensors,
)
from tierlm.cli import main
from tierlm.config import ConfigError, from_dict
from tierlm.memory import disk as disk_module
from tierlm.memory.placement import PlacementReport
from tierlm.monitor.metrics import read_metrics
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.state import as_tensor
from tierlm.train import Trainer
from tierlm.train import preflight as preflight_module
from tierlm.train.preflight import (
    DiskNeed,
    check_disk_space,
    overcommit_warning,
    read_meminfo,
    resolve_offload_dir,
)
from tierlm.train.safety import (
    DiskSpaceError,
    HostMemoryError,
    NonFiniteError,
    NonFiniteGuard,
    check_token_stream,
)

ROOT = Path(__file__).parents[2]
SMALL_TEXT: Path


def quiet(_msg):
    pass


@pytest.fixture(scope="module", autouse=True)
def _small_text(tmp_path_factory):
    """A small corpus: these tests are about the machinery, not the text, and the built-in
    Shakespeare costs seconds to tokenize per trainer."""
    global SMALL_TEXT
    SMALL_TEXT = tmp_path_factory.mktemp("data") / "text.txt"
    lines = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5}."
             for i in range(1500)]
    SMALL_TEXT.write_text("\n".join(lines) + "\n")


def small_run() -> list[str]:
    """CLI flags of a seconds-long run: the tiny preset on the small corpus."""
    return ["--config", str(ROOT / "configs/tiny.yaml"), "--data", str(SMALL_TEXT),
            "--seq-len", "32", "--data.vocab_size", "512", "--train.sample_tokens", "0",
            "--eval-every", "0", "--max-steps", "4"]


def tiny_cfg(out, *, policy="none", **train):
    base = {"max_steps": 6, "batch_size": 4, "eval_every": 0, "eval_batches": 1,
            "sample_tokens": 0}
    base.update(train)
    return from_dict({
        "model": {"size": "tiny"},
        "data": {"seq_len": 32, "vocab_size": 512, "train": str(SMALL_TEXT)},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": base,
        "memory": {"offload_policy": policy},
        "run": {"out": str(out), "device": "cpu", "seed": 3},
    })


def losses_of(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


# -- the file format ----

def test_written_safetensors_load_with_the_reference_library_and_back(tmp_path):
    flat = torch.arange(40, dtype=torch.float32)
    tensors = {
        "w": flat.narrow(0, 4, 12).view(3, 4),  # a view into a flat buffer, written in place
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
    }
    sha, size = write_safetensors(tmp_path / "a.safetensors", tensors)
    raw = (tmp_path / "a.safetensors").read_bytes()
    assert sha == hashlib.sha256(raw).hexdigest() and size == len(raw)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    # and our reader reads what the library writes
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "b.safetensors"))
    ours = TensorFiles([tmp_path / "b.safetensors"])
    assert all(torch.equal(ours[k], tensors[k]) and ours[k].dtype == tensors[k].dtype
               for k in tensors)


def test_a_pickle_is_never_unpickled(tmp_path):
    """A pickle planted as a checkpoint's tensor file (with a matching manifest, so it passes
    the checksum) is refused as not-safetensors; its payload never runs."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(pickle.dumps(Payload()))
    write_safetensors(ckpt / "optimizer.safetensors", {})
    write_safetensors(ckpt / "rng.safetensors", {"cpu": torch.get_rng_state()})
    (ckpt / "state.json").write_text(json.dumps({"format_version": 2, "step": 1}))
    manifest = {f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                         "size_bytes": f.stat().st_size} for f in ckpt.iterdir()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(ckpt)
    assert not marker.exists()


def _raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize("header, data", [
    # two names over the same bytes: each fits the file, together they do not tile it
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    # bytes past the last tensor, which no header entry accounts for
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)),
    # a gap between two tensors
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12)),
], ids=["overlap", "trailing-bytes", "gap"])
def test_a_safetensors_header_that_does_not_tile_its_data_is_refused(tmp_path, header, data):
    """The safetensors library validates every header we read: entries that overlap, leave a
    gap or stop short of the file's end are refused, not read as whatever bytes they name."""
    path = tmp_path / "x.safetensors"
    _raw_safetensors(path, header, data)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        TensorFiles([path])


def test_manifest_may_not_name_files_outside_the_checkpoint(tmp_path):
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / MANIFEST).write_text(json.dumps({"../../etc/passwd": {"sha256": "0",
                                                                   "size_bytes": 1}}))
    with pytest.raises(CheckpointError, match="names '../../etc/passwd'"):
        verify_checkpoint(ckpt)


# -- checkpoints of the tiered runtime ----

def _engine(tmp_path, policy="disk", layers=6, seed=0):
    model = tiny_model("llama_untied", layers=layers, seed=seed)
    return model, new_engine(model, tmp_path / "offload", policy=policy)


def _save(run_dir, stepper, model, step, keep=0):
    state = TrainState(step=step, sampler={"epoch": 0, "index": step}, run_config={})
    return save_checkpoint(run_dir, shards=stepper.state_shards(), model_config=model.config,
                           tokenizer=None, state=state, keep=keep)


def test_disk_tier_checkpoint_streams_one_segment_at_a_time(tmp_path):
    """Saving the disk tier's state stages one parameter at a time (the ledger's host peak during
    the save is the largest parameter, plus at most 4 KiB of O_DIRECT alignment: not even one
    segment's master), and the sharded
    checkpoint restores the exact state in either runtime: weights and optimizer state as saved,
    and the same weights and optimizer state after the next step."""
    model, eng = _engine(tmp_path)
    for b in batches(2, 1):
        eng.step(b, 1e-2)
    eng.synchronize()
    eng.ledger.reset_step()
    before = eng.ledger.snapshot()["host_bytes"]
    path = _save(tmp_path / "run", eng, model, step=2)
    host_peak = eng.ledger.snapshot()["host_step_peak_bytes"] - before
    largest = max(s.numel for st in eng.states for s in st.layout.slots) * 4
    segment = max(st.numel for st in eng.states) * 4
    assert largest <= host_peak <= largest + 4096 < segment
    names = {f.name for f in path.iterdir()}
    assert {f"model-block.{i}.safetensors" for i in range(6)} <= names
    assert {"model-embed.safetensors", "optimizer-head.safetensors"} <= names

    weights, optim, state = load_checkpoint(path)
    assert state["step"] == 2
    want_w, want_o = eng.weights(), eng.optimizer_state()
    assert set(weights) == set(want_w) and set(optim) == set(want_o)
    assert all(torch.equal(weights[k], want_w[k]) for k in want_w)
    assert all(torch.equal(optim[k], want_o[k]) for k in want_o)

    # into a fresh engine (its offload dir elsewhere) and into the reference runtime
    m2, eng2 = _engine(tmp_path / "other", seed=1)
    eng2.load(weights, optim)
    m3 = tiny_model("llama_untied", layers=6, seed=2)
    ref = ReferenceStep(m3, OPTIM, grad_clip=1.0, device=torch.device("cpu"))
    ref.load(weights, optim)
    for restored in (eng2, ref):
        got_w, got_o = restored.weights(), restored.optimizer_state()
        assert set(got_w) == set(want_w) and set(got_o) == set(want_o)
        assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)
        assert all(torch.equal(got_o[k], want_o[k]) for k in want_o)
    nxt = batches(1, 1, seed=9)[0]
    out1, out2, out3 = eng.step(nxt, 1e-2), eng2.step(nxt, 1e-2), ref.step(nxt, 1e-2)
    assert out1["loss"] == out2["loss"] == pytest.approx(out3["loss"], rel=1e-6)
    w1, w2, w3 = eng.weights(), eng2.weights(), ref.weights()
    o1, o2, o3 = eng.optimizer_state(), eng2.optimizer_state(), ref.optimizer_state()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert all(torch.equal(o1[k], o2[k]) for k in o1)
    # the reference reaches the same state within invariant 1's fp32 tolerance (each tensor to
    # 1e-6 of its own scale: the second moments are many orders below the weights)
    for got, want in ((w3, w1), (o3, o1)):
        assert set(got) == set(want)
        for k, v in want.items():
            scale = v.abs().max().item()
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6 * scale, msg=k)
    for e in (eng, eng2):
        e.close()


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    from tierlm.checkpoint import check_weight_names

    model, eng = _engine(tmp_path, policy="host", layers=1)
    path = _save(tmp_path / "run", eng, model, step=1)
    weights, _, _ = load_checkpoint(path)
    shapes = {n: tuple(t.shape) for n, t in eng.weights().items()}
    check_weight_names(shapes, weights, path)
    name = next(iter(shapes))
    with pytest.raises(CheckpointError, match=f"shapes .'{name}"):
        check_weight_names({**shapes, name: (3, 3)}, weights, path)
    eng.close()


def test_keep_last_k_checkpoints_and_recover_after_crash(tmp_path):
    model, eng = _engine(tmp_path, policy="host", layers=1)
    run = tmp_path / "run"
    for step in range(1, 6):
        _save(run, eng, model, step, keep=2)
    assert [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000005"]

    root = run / "checkpoints"
    # a crash mid-write leaves a temporary directory; one between the two renames of a
    # re-save leaves the old checkpoint moved aside
    shutil.copytree(root / "step_00000005", root / ".step_00000006.tmp-123")
    os.replace(root / "step_00000005", root / ".step_00000005.old-77")
    logs = []
    recover_checkpoints(run, logs.append)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000005"]
    verify_checkpoint(root / "step_00000005")
    assert any("restored" in m for m in logs) and any("interrupted" in m for m in logs)
    eng.close()


def test_flipped_byte_falls_back_loudly_and_resume_matches(tmp_path, capsys):
    """One flipped byte in the newest checkpoint: resume warns with the file name, moves it
    aside, continues from the previous one and reproduces the uninterrupted losses; with every
    checkpoint corrupt, a clear error and nothing loaded."""
    straight = Trainer(tiny_cfg(tmp_path / "a"), log=quiet)
    straight.train()

    Trainer(tiny_cfg(tmp_path / "b", save_every=2), log=quiet).train(until_step=4)
    ckpts = list_checkpoints(tmp_path / "b")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    flip_byte(ckpts[-1] / "optimizer.safetensors")
    rc = main(["train", "--resume", str(tmp_path / "b")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "optimizer.safetensors fails its checksum" in out
    assert "resumed from" in out and "step_00000002 at step 2" in out
    assert any(p.name.startswith("corrupt-step_00000004") for p in (ckpts[0].parent).iterdir())
    assert losses_of(tmp_path / "b") == losses_of(tmp_path / "a")

    for p in list_checkpoints(tmp_path / "b"):
        flip_byte(p / "model.safetensors")
    rc = main(["train", "--resume", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2 and "tierlm: error:" in err and "every checkpoint failed verification" in err


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    """`--resume auto`: a fresh start in an empty --out, the newest valid checkpoint once there
    is one, and an error (never a silent restart) when checkpoints exist but none verifies.
    The kill test runs the whole loop through the CLI."""
    from tierlm.checkpoint import resume_point

    run = tmp_path / "run"
    logs = []
    assert resume_point("auto", str(run), logs.append) == (run, None)
    assert "starting a fresh run" in logs[-1]
    assert resume_point(None, str(run)) == (None, None)
    model, eng = _engine(tmp_path, policy="host", layers=1)
    for step in (2, 4):
        _save(run, eng, model, step)
    assert resume_point("auto", str(run), quiet) == (run, run / "checkpoints" / "step_00000004")
    for p in list_checkpoints(run):
        flip_byte(p / "model-embed.safetensors")
    with pytest.raises(CheckpointError, match="every checkpoint failed verification"):
        resume_point("auto", str(run), quiet)
    with pytest.raises(ConfigError, match="--resume auto needs --out"):
        from_dict({"run": {"resume": "auto"}})
    eng.close()


# -- disk ----

def test_preflight_refuses_with_the_numbers():
    here = Path.cwd()
    needs = [DiskNeed("the disk tier", here / "off", 3 << 30),
             DiskNeed("3 checkpoint(s)", here / "ck", 1 << 30)]
    with pytest.raises(DiskSpaceError) as info:
        check_disk_space(needs, free=lambda p: 2 << 30)
    msg = str(info.value)
    assert "needs 4.00 GiB" in msg and "the disk tier 3.00 GiB" in msg and "2.00 GiB is free" in msg
    assert "--keep-checkpoints" in msg
    check_disk_space(needs, free=lambda p: 5 << 30)


def test_preflight_refuses_a_run_before_its_first_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight_module, "free_disk_bytes", lambda p: 1 << 20)
    rc = main(["train", *small_run(), "--out",
               str(tmp_path / "r"), "--device", "cpu", "--offload-policy", "disk"])
    err = capsys.readouterr().err
    assert rc == 2 and "not enough disk space" in err and "the disk tier" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert not (tmp_path / "r" / "offload").exists()  # refused before anything was written


def _arm_enospc(monkeypatch, after_calls: int):
    """Make the disk tier's pwrite fail with ENOSPC after `after_calls` more calls."""
    real = disk_module._pwrite_all
    calls = {"n": 0}

    def pwrite(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] > after_calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(disk_module, "_pwrite_all", pwrite)


def test_disk_full_mid_run_stops_cleanly_with_the_checkpoint_intact(tmp_path, monkeypatch):
    first = Trainer(tiny_cfg(tmp_path, policy="disk", save_every=2), log=quiet)
    first.train(until_step=2)
    first.stepper.close()
    good = list_checkpoints(tmp_path)[-1]
    cfg = tiny_cfg(tmp_path, policy="disk", save_every=2)
    cfg.run.resume = str(tmp_path)
    second = Trainer(cfg, log=quiet)
    _arm_enospc(monkeypatch, after_calls=5)
    with pytest.raises(DiskSpaceError) as info:
        second.train()
    msg = str(info.value)
    assert "disk full" in msg and str(tmp_path / "offload") in msg and "needs" in msg
    assert f"last good checkpoint {good} is intact and verified" in msg
    assert list_checkpoints(tmp_path) == [good]
    verify_checkpoint(good)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_disk_full_during_a_checkpoint_write_keeps_the_previous(tmp_path, monkeypatch):
    Trainer(tiny_cfg(tmp_path, save_every=2), log=quiet).train(until_step=2)
    good = list_checkpoints(tmp_path)[-1]
    cfg = tiny_cfg(tmp_path, save_every=2)
    cfg.run.resume = str(tmp_path)
    t = Trainer(cfg, log=quiet)
    from tierlm.checkpoint import publish as ckpt_module

    real = ckpt_module.write_safetensors

    def full(path, tensors):
        real(path, tensors)  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_module, "write_safetensors", full)
    with pytest.raises(DiskSpaceError) as info:
        t.train()
    msg = str(info.value)
    assert "disk full while writing checkpoint" in msg and "MiB are free" in msg
    assert "step_00000002 is untouched" in msg
    assert list_checkpoints(tmp_path) == [good]
    verify_checkpoint(good)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]


def _can_mount_tmpfs(where: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(where)], check=True)
    return ok


def test_runs_on_small_real_filesystems(tmp_path, capsys):
    """Real filesystems made for the test (tmpfs). With --offload-dir on one of 2 MiB, less
    than the tiny model's disk tier, the run is refused before its first step with the numbers.
    With the whole run on one of 64 MiB that another process fills after the first checkpoint,
    the next write hits ENOSPC and the run stops cleanly: previous checkpoint intact, verified."""
    small, big = tmp_path / "small", tmp_path / "big"
    if not _can_mount_tmpfs(small):
        pytest.skip("needs root to mount a tmpfs (the injected-ENOSPC tests cover the logic)")
    big.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(big)], check=True)
    try:
        args = ["train", *small_run(), "--device", "cpu",
                "--offload-policy", "disk", "--offload-dir", str(small), "--train.sample_tokens",
                "0", "--eval-every", "0", "--max-steps", "4", "--out", str(tmp_path / "r1")]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "not enough disk space" in err and str(small) in err and "is free there" in err
        assert not any(small.iterdir())

        run = big / "run"
        Trainer(tiny_cfg(run, policy="disk", save_every=2), log=quiet).train(until_step=2)
        good = list_checkpoints(run)[-1]
        cfg = tiny_cfg(run, policy="disk", save_every=2)
        cfg.run.resume = str(run)
        t = Trainer(cfg, log=quiet)
        with (big / "filler").open("wb") as f:  # someone else fills the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        with pytest.raises(DiskSpaceError) as info:
            t.train()
        msg = str(info.value)
        assert "No space left" in msg or "disk full" in msg
        assert str(big) in msg and "free" in msg
        assert f"last good checkpoint {good} is intact and verified" in msg
        assert list_checkpoints(run) == [good]
        verify_checkpoint(good)
    finally:
        for mnt in (small, big):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- host memory ----

def test_overcommit_detection():
    meminfo = read_meminfo("MemTotal: 16000000 kB\nMemAvailable: 4000000 kB\nSwapFree: 0 kB\n")
    assert meminfo["MemAvailable"] == 4000000 * 1024
    need = 8 * 10**9
    for mode in (0, 1):
        warning = overcommit_warning(need, mode, meminfo)
        assert warning and f"vm.overcommit_memory={mode}" in warning and "OOM killer" in warning
    assert overcommit_warning(need, 2, meminfo) is None  # strict: the allocation itself fails
    assert overcommit_warning(10**9, 1, meminfo) is None  # fits comfortably


def test_host_budget_defaults_to_a_fraction_of_available_ram(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight_module, "available_ram_bytes", lambda: 10 << 30)
    t = Trainer(tiny_cfg(tmp_path, policy="tiered"), log=quiet)
    share = t.stepper.opts.host_budget_bytes  # the default budget less what the run holds
    default = int(0.7 * (10 << 30))
    assert default - (200 << 20) < share <= default - preflight_module.RUNTIME_RESERVE_BYTES
    t.stepper.close()
    cfg = tiny_cfg(tmp_path / "b", policy="tiered")
    cfg.memory.host_budget = "3MiB"  # explicit: the host tier's budget, as the ledger counts it
    t = Trainer(cfg, log=quiet)
    assert t.stepper.opts.host_budget_bytes == 3 << 20
    t.stepper.close()
    monkeypatch.setattr(preflight_module, "available_ram_bytes", lambda: 80 << 20)
    with pytest.raises(HostMemoryError, match="free RAM, or set --host-budget"):
        Trainer(tiny_cfg(tmp_path / "c", policy="tiered"), log=quiet)


def test_more_ram_than_available_is_refused_before_the_first_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight_module, "available_ram_bytes", lambda: 1 << 20)
    monkeypatch.setattr(preflight_module, "_system_overcommit",
                        lambda: (1, {"MemAvailable": 1 << 20}))
    rc = main(["train", *small_run(), "--out",
               str(tmp_path / "r"), "--device", "cpu", "--offload-policy", "host",
               "--host-budget", "1GiB"])
    out, err = capsys.readouterr()
    assert rc == 2 and "host memory: this run needs" in err and "--host-budget" in err
    assert "vm.overcommit_memory=1" in out
    with pytest.raises(HostMemoryError):
        Trainer(tiny_cfg(tmp_path / "ref"), log=quiet)  # the reference runtime on the CPU too


_RSS_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    if sys.argv[1] == "train":
        from tierlm.cli import main
        rc = main(sys.argv[1:])
        assert rc == 0, rc
    else:  # everything a run holds that does not depend on the model, and no model
        import torch, transformers, tierlm.cli, tierlm.train
        from tierlm.data import encode_documents, load_corpus, load_or_train_tokenizer
        from tierlm.paths import cache_dir
        corpus = load_corpus(sys.argv[2], None)
        tok = load_or_train_tokenizer([d.text for d in corpus.train], 512,
                                      cache_dir() / "tokenizers")
        ids = encode_documents(tok, corpus.train)
        x = torch.randn(64, 64, requires_grad=True)
        (x @ x).sum().backward()  # torch's CPU kernels and thread pools, initialised
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            print("PEAK", int(line.split()[1]) * 1024)
""")


def _peak_rss(args, env) -> int:
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, *args], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("PEAK")[-1])


def test_host_budget_below_the_naive_need_holds_peak_rss(tmp_path):
    """The `small` preset (14M params here: 16 B/param of fp32 master weights, gradients and
    AdamW moments is ~220 MiB, the naive need) trained with --host-budget 160MiB: the tiered
    placement sends most state to the disk tier, training completes, and the subprocess's
    measured peak RSS (VmHWM) stays under the host budget plus the device budget (the "device"
    is RAM on a CPU-only machine) plus the fixed overhead that does not depend on the model:
    the peak RSS of a process that imports torch, transformers and tierlm, loads the same data
    and tokenizer and initialises torch's CPU kernels, but builds no model, measured here the
    same way."""
    data = tmp_path / "data.txt"
    data.write_text(("the quick brown fox jumps over the lazy dog. " * 8 + "\n") * 400)
    env = {**os.environ, "TIERLM_CACHE": str(tmp_path / "cache")}
    host_budget, device_budget = 160 << 20, 64 << 20
    args = ["train", "--model-size", "small", "--data", str(data), "--seq-len", "64",
            "--data.vocab_size", "512", "--batch-size", "2", "--max-steps", "3",
            "--eval-every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
            "--device", "cpu", "--offload-policy", "tiered", "--host-budget",
            str(host_budget), "--device-budget", str(device_budget), "--out",
            str(tmp_path / "run")]
    overhead = _peak_rss(["baseline", str(data)], env)
    peak = _peak_rss(args, env)
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["disk_read_bytes"] > 0 for r in recs)  # the disk tier carried the state
    assert all(r["host_peak_bytes"] <= host_budget for r in recs)
    n_params = sum(t.numel() for t in load_file(
        str(tmp_path / "run" / "hf" / "model.safetensors")).values())
    assert host_budget < n_params * 16  # below the naive need
    cap = host_budget + device_budget + overhead
    print(f"peak RSS {peak / 2**20:.0f} MiB; cap {cap / 2**20:.0f} MiB = host budget "
          f"{host_budget >> 20} + device budget {device_budget >> 20} + runtime overhead "
          f"{overhead / 2**20:.0f}")
    assert peak < cap


# -- numerical faults ----

def test_skipped_step_leaves_disk_tier_state_bitwise_unchanged(tmp_path):
    model, eng = _engine(tmp_path, layers=2)
    eng.step(batches(1, 1)[0], 1e-2)

    def snapshot():
        out = {}
        for name, w, o in eng.state_shards():
            out.update({f"{name}/{k}": as_tensor(v).clone() for k, v in {**w, **o}.items()})
        return out

    before = snapshot()
    real = eng._finish_step

    def poisoned(lr):  # one parameter's gradient norm is inf, as an overflow would make it
        eng.param_norms[next(iter(eng.param_norms))] = torch.tensor(float("inf"))
        return real(lr)

    eng._finish_step = poisoned
    out = eng.step(batches(1, 1, seed=5)[0], 1e-2)
    eng._finish_step = real
    assert out["skipped"] and eng.skipped_steps == 1
    after = snapshot()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not eng.step(batches(1, 1, seed=6)[0], 1e-2)["skipped"]
    eng.close()


def test_non_finite_streak_stops_with_a_diagnosis(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=20, max_skipped_in_a_row=3)
    t = Trainer(cfg, log=quiet)
    weights_before, optim_before = {}, {}
    real = t.stepper.step

    def step(batches_, lr):
        if t.step == 2:  # copies: the reference runtime hands out its live tensors
            weights_before.update({k: v.clone() for k, v in t.stepper.weights().items()})
            optim_before.update({k: v.clone() for k, v in t.stepper.optimizer_state().items()})
        return real(batches_, lr)

    t.stepper.step = step
    t.stepper.params[0].register_hook(  # from step 3 on, a gradient overflows
        lambda g: torch.full_like(g, float("nan")) if t.step >= 2 else g)
    with pytest.raises(NonFiniteError) as info:
        t.train()
    msg = str(info.value)
    assert "3 steps in a row (3..5)" in msg and "still those after step 2" in msg
    assert "gradient overflows in the backward" in msg and "learning rate was" in msg
    assert "A checkpoint of the last good state was written" in msg
    assert t.step == 5
    weights, optim, state = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert state["step"] == 5 and state["skipped_steps"] == 3
    # the skipped steps touched neither the weights nor the optimizer (moments, step counts)
    assert weights.keys() == weights_before.keys() and optim.keys() == optim_before.keys()
    assert all(torch.equal(weights[k], weights_before[k]) for k in weights_before)
    assert all(torch.equal(optim[k], optim_before[k]) for k in optim_before)


def test_diagnosis_tells_a_forward_overflow_and_bad_weights_apart():
    recs = [{"step": s, "loss": 2.0, "grad_norm": 1.0 * 4**s, "lr": 0.5, "skipped": False}
            for s in range(1, 9)]
    recs += [{"step": s, "loss": float("nan"), "grad_norm": float("nan"), "lr": 0.5,
              "skipped": True} for s in range(9, 11)]
    guard = NonFiniteGuard(2, precision="bf16", grad_clip=0.0, weights_finite=lambda: True)
    with pytest.raises(NonFiniteError) as info:
        for r in recs:
            guard.observe(r)
    msg = str(info.value)
    assert "loss is already non-finite in the forward pass" in msg and "in bf16" in msg
    assert "the run is diverging" in msg and "learning rate was 0.5" in msg
    guard = NonFiniteGuard(2, precision="fp32", grad_clip=1.0, weights_finite=lambda: False)
    with pytest.raises(NonFiniteError, match="weights themselves hold inf/NaN"):
        for r in recs:
            guard.observe(r)
    never = NonFiniteGuard(0, precision="fp32", grad_clip=1.0, weights_finite=lambda: True)
    for r in recs + recs:
        never.observe(r)


def test_out_of_vocabulary_ids_name_the_file_and_position(tmp_path):
    from tierlm.data import Document

    docs = [Document("a.jsonl:1", "x"), Document("a.jsonl:2", "y"), Document("b.txt", "z")]
    eos = 9
    ids = torch.tensor([1, 2, eos, 3, 4, 5, 77, eos, 6, eos])
    with pytest.raises(Exception) as info:
        check_token_stream(ids, 10, docs, eos, "training data")
    msg = str(info.value)
    assert "token id 77 in a.jsonl:2 (token index 3 in that document, position 6" in msg
    assert "vocabulary of 10" in msg
    floats = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(Exception, match="token id nan in a.jsonl:1 .token index 1 "):
        check_token_stream(floats, 10, docs, eos, "training data")
    check_token_stream(torch.tensor([1, eos, 2, eos]), 10, docs, eos, "training data")


# -- interrupts ----

def test_ctrl_c_mid_step_checkpoints_a_consistent_state(tmp_path):
    straight = Trainer(tiny_cfg(tmp_path / "a", policy="disk"), log=quiet)
    straight.train()

    t = Trainer(tiny_cfg(tmp_path / "b", policy="disk"), log=quiet)
    real = t.stepper.step

    def step(batches_, lr):
        if t.step == 2:  # Ctrl-C arrives in the middle of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real(batches_, lr)

    t.stepper.step = step
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    with pytest.raises(KeyboardInterrupt):
        t.train()
    t.stepper.close()
    assert signal.getsignal(signal.SIGINT) is before  # restored
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step_00000003"]
    cfg = tiny_cfg(tmp_path / "b", policy="disk")
    cfg.run.resume = str(tmp_path / "b")
    resumed = Trainer(cfg, log=quiet)
    resumed.train()
    assert losses_of(tmp_path / "b") == losses_of(tmp_path / "a")
    w1, w2 = straight.stepper.weights(), resumed.stepper.weights()
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    o1, o2 = straight.stepper.optimizer_state(), resumed.stepper.optimizer_state()
    assert o1.keys() == o2.keys() and all(torch.equal(o1[k], o2[k]) for k in o1)
    resumed.stepper.close()
    straight.stepper.close()


# -- untrusted input ----

def test_paths_and_remote_code(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert resolve_offload_dir(None, run) == run / "offload"
    assert resolve_offload_dir("scratch/off", run) == run / "scratch/off"
    assert resolve_offload_dir(str(tmp_path / "elsewhere"), run) == tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match="may not contain '..'"):
        resolve_offload_dir("../../etc", run)
    with pytest.raises(ConfigError, match="may not contain '..'"):
        from_dict({"memory": {"offload_policy": "disk", "offload_dir": "../x"}})

    from tierlm.cli import build_parser, config_from_args

    def parsed(*flags):
        return config_from_args(build_parser().parse_args(["print-config", *flags]))

    assert parsed().model.trust_remote_code is False
    assert parsed("--trust-remote-code").model.trust_remote_code is True
    assert parsed("--trust-remote-code", "false").model.trust_remote_code is False

    # the flag reaches transformers, and only when given
    from tierlm.models import hf

    seen = {}

    def fake_from_pretrained(path, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(hf.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(hf, "_check_checkpoint_dir", lambda p: "llama")
    for flag in (False, True):
        with pytest.raises(RuntimeError, match="stop here"):
            hf.load_hf_model(tmp_path, trust_remote_code=flag)
        assert seen["trust_remote_code"] is flag and seen["use_safetensors"] is True


def test_non_finite_config_numbers_are_refused():
    for value in ("nan", "inf", float("nan"), "-inf"):
        with pytest.raises(ConfigError, match="expected a finite number"):
            from_dict({"optim": {"lr": value}})
    with pytest.raises(ConfigError, match="run.keep_checkpoints: must be >= 0"):
        from_dict({"run": {"keep_checkpoints": -1}})


def test_cli_prints_reliability_errors_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "__init__", lambda self, cfg, log=print: (_ for _ in ()).throw(
        DiskSpaceError("not enough disk space: test")))
    assert main(["train", *small_run(), "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm: error: not enough disk space") and "Traceback" not in err


def test_placement_check_runs_before_anything_is_written(tmp_path):
    seen = []

    def check(report: PlacementReport) -> None:
        seen.append((report.disk_bytes, (tmp_path / "offload").exists()))
        raise DiskSpaceError("refused")

    model = tiny_model("llama_untied", layers=2)
    opts = EngineOptions(policy="disk", offload_dir=str(tmp_path / "offload"),
                         check_placement=check)
    with pytest.raises(DiskSpaceError):
        build_engine(model, OPTIM, opts, device=torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    assert seen == [(16 * n_params, False)]  # master, gradient and both moments, nothing yet

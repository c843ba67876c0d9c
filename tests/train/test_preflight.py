"""--train.save_final false (a benchmark run, bench/gpu_all.sh): the run writes no final
checkpoint and no export, and the preflight reserves no disk for them (a 7B benchmark on a
64 GiB disk was refused for ~108 GB it would never write)."""

from tierlm.config import from_dict
from tierlm.train import run_training
from tierlm.train.preflight import Preflight

TEXT = "the quick brown fox jumps over the lazy dog. " * 400


def _needs(tmp_path, **train):
    cfg = from_dict({"train": {"max_steps": 10, **train}, "run": {"out": str(tmp_path / "run")}})
    pre = Preflight(cfg, tmp_path / "run", n_params=7_000_000_000, device_is_cpu=False,
                    optim_state_bytes=56_000_000_000, start_rss_bytes=0)
    return {need.what: need.nbytes for need in pre.disk_needs(None)}


def test_preflight_reserves_no_checkpoint_or_export_without_a_final_save(tmp_path):
    assert set(_needs(tmp_path)) == {"1 checkpoint(s)", "the Hugging Face export"}
    assert _needs(tmp_path, save_final=False) == {}
    # periodic checkpoints are still written, and reserved; the export is not
    needs = _needs(tmp_path, save_final=False, save_every=5)
    assert [what.endswith("checkpoint(s)") for what in needs] == [True]


def test_a_run_without_a_final_save_writes_no_checkpoint_or_export(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = from_dict({
        "model": {"size": "tiny"},
        "data": {"train": str(tmp_path / "corpus.txt"), "seq_len": 16, "vocab_size": 300},
        "train": {"max_steps": 1, "batch_size": 2, "eval_batches": 1, "eval_every": 0,
                  "sample_tokens": 0, "save_final": False},
        "run": {"out": str(tmp_path / "run"), "device": "cpu"},
    })
    result = run_training(cfg, log=lambda _m: None)
    assert result.final_checkpoint is None and len(result.losses) == 1
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "hf").exists()

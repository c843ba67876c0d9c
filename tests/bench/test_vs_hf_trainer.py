"""bench/vs_hf_trainer.py in seconds: a 2-block checkpoint written by `save_pretrained`, two steps
of two micro-batches through the Hugging Face Trainer and through `tierlm train --model DIR
--offload-policy none`, in this process. The two train the same model on the same rows: their
losses agree step for step (a different row order, loss normalisation over the accumulated
micro-batches, learning rate or clipping would part them by far more than fp32 rounding)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers.trainer")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vs_hf_trainer.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("vs_hf_trainer", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_and_the_reference_trainer_train_the_same_model(tmp_path):
    bench = load_bench()
    data = tmp_path / "text.txt"
    data.write_text("".join(f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs.\n"
                            for i in range(400)))
    args = bench.build_parser().parse_args([
        "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "320", "--tokenizer-vocab", "300",
        "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--steps", "2",
        "--lr", "1e-2", "--data", str(data)])
    (tmp_path / "ckpt").mkdir()
    bench.make_checkpoint(args, tmp_path / "ckpt")
    bench.make_rows(args, tmp_path / "ckpt", tmp_path / "rows.safetensors")

    hf = bench.hf_worker(args, tmp_path)
    ref = bench.tierlm_worker(args, tmp_path, "reference")

    assert len(hf["losses"]) == len(ref["losses"]) == 2
    assert len(hf["step_s"]) == len(ref["step_s"]) == 2
    # step 1: the same weights and rows; step 2: after the same update (lr 1e-2 moves the loss)
    assert ref["losses"] == pytest.approx(hf["losses"], rel=1e-5)
    assert abs(hf["losses"][1] - hf["losses"][0]) > 1e-3

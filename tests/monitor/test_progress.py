"""What a run shows: its plan and both tokens/s at the start, in the live lines and at the end;
progress lines for the phases that are not steps (loading, evaluation, checkpoint, export,
sampling); what `tierlm export` read and wrote; the fp8 emulation note; the trained parameters
of a LoRA run; the report's panels that have something to show."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tests.monitor_helpers import tiny_corpus, tiny_run_cfg
from tierlm.cli import main
from tierlm.config import PrecisionConfig, from_dict
from tierlm.monitor.metrics import read_metrics
from tierlm.progress import LineProgress, open_progress

CPU = torch.device("cpu")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_line_progress_says_name_done_of_total_eta_and_the_end():
    lines: list[str] = []
    clock = Clock()
    progress = LineProgress(lines.append, every_s=5.0, clock=clock)
    with progress.phase("eval (step 0)", 10, "batches") as phase:
        for _ in range(4):
            clock.t += 2.0
            phase.advance()
    assert lines[0] == "eval (step 0): 0/10 batches"
    # one line at most every 5 s: after 6 s, 3 batches done, 7 to go at 2 s each
    assert lines[1] == "eval (step 0): 3/10 batches, 0:00:06 elapsed, eta 0:00:14"
    assert lines[-1] == "eval (step 0): 4 batches in 0:00:08"
    assert len(lines) == 3

    lines.clear()
    phase = progress.phase("export bfloat16 to out", 3 * 2**30, "bytes")
    clock.t += 10.0
    phase.advance(2**30)
    phase.close()
    phase.close()  # closing twice says it once
    assert lines == ["export bfloat16 to out: 0 B of 3.00 GiB",
                     "export bfloat16 to out: 1.00 GiB of 3.00 GiB, 0:00:10 elapsed, eta 0:00:20",
                     "export bfloat16 to out: 1.00 GiB in 0:00:10 (102.40 MiB/s)"]


def test_a_phase_ended_by_an_error_does_not_say_done():
    lines: list[str] = []
    with pytest.raises(OSError), LineProgress(lines.append, clock=Clock()).phase(
            "save checkpoint (step 3)", 2**20, "bytes") as phase:
        phase.advance(2**19)
        raise OSError(28, "No space left on device")
    assert lines[-1] == "save checkpoint (step 3): stopped after 512.00 KiB in 0:00:00"


def test_progress_is_lines_off_a_terminal(tmp_path):
    with (tmp_path / "log").open("w") as f:
        assert isinstance(open_progress(print, stream=f), LineProgress)


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """A two-step run on the disk tier, through `run_training`: its log lines (start, phases,
    end) and the live view's lines on stdout."""
    from tierlm.train import run_training

    root = tmp_path_factory.mktemp("disk_run")
    cfg = tiny_run_cfg(root / "run", tiny_corpus(root), policy="disk", max_steps=2,
                       eval_batches=2, sample_tokens=3)
    lines: list[str] = []
    stdout = io.StringIO()  # not a terminal: the live view prints lines
    with contextlib.redirect_stdout(stdout):
        result = run_training(cfg, log=lines.append)
    return result, lines, stdout.getvalue().splitlines()


def test_a_run_starts_with_its_plan_and_predicted_tokens_per_s(disk_run):
    _, lines, _ = disk_run
    text = "\n".join(lines)
    assert ("plan: state of 4 segments: 0 on device, 0 in host RAM, 4 on disk; compute "
            "weights resident on the device: none; streamed: 4") in text
    (predicted,) = [ln for ln in lines if ln.startswith("plan: predicted step ")]
    assert " tok/s, trained " in predicted and "(100.0% of the tokens have a loss)" in predicted
    # before the first evaluation
    assert lines.index(predicted) < next(i for i, ln in enumerate(lines)
                                         if ln.startswith("eval (step 0)"))


def test_live_and_end_lines_carry_tokens_per_s_and_trained_beside_the_plan(disk_run):
    result, lines, out = disk_run
    steps = [ln for ln in out if ln.startswith("step 2/2")]
    assert steps and " tok/s (plan " in steps[0] and ", trained " in steps[0]
    recs = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    for r in recs:
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
        assert r["trained_tokens_per_s"] == pytest.approx(r["loss_tokens"] / r["step_time_s"])
        assert r["predicted_tokens_per_s"] == pytest.approx(4 * 32 / r["predicted_step_time_s"])
    text = "\n".join(lines)
    for start in ("peak device bytes: predicted", "peak host bytes: predicted",
                  "disk tier bytes: predicted", "step time (median): predicted",
                  "tokens/s (median): predicted", "trained tokens/s (median): predicted"):
        assert start in text, start
    (end,) = [r for r in read_metrics(result.run_dir / "metrics.jsonl")
              if "predicted_disk_bytes" in r]
    assert end["measured_disk_bytes"] > 0 and end["measured_step_time_s"] > 0
    assert end["measured_tokens_per_s"] > 0 and end["predicted_step_time_s"] > 0


def test_phases_that_are_not_steps_show_progress(disk_run):
    result, lines, _ = disk_run
    for name, total in (("eval (step 0)", "0/2 batches"), ("eval (step 2)", "0/2 batches"),
                        ("sampling", "0/3 tokens")):
        assert f"{name}: {total}" in lines, name
        assert any(ln.startswith(f"{name}: ") and " in 0:" in ln for ln in lines), name
    assert any(ln.startswith("save checkpoint (step 2): 0 B of ") for ln in lines)
    assert any(ln.startswith("save checkpoint (step 2): ") and " in 0:" in ln for ln in lines)
    export = f"export float32 to {result.run_dir / 'hf'}"
    assert any(ln.startswith(f"{export}: 0 B of ") for ln in lines)
    assert any(ln.startswith(f"{export}: ") and " in 0:" in ln for ln in lines)


def test_export_names_the_checkpoint_the_dtype_and_the_output(disk_run, tmp_path, capsys):
    result, _, _ = disk_run
    out = tmp_path / "exported"
    assert main(["export", str(result.run_dir), str(out), "--export-dtype", "bfloat16"]) == 0
    said = capsys.readouterr().out.splitlines()
    ckpt = result.final_checkpoint
    assert said[0] == (f"export: checkpoint {ckpt} as bfloat16 (--export-dtype bfloat16) "
                       f"to {out}")
    assert said[1].startswith(f"export bfloat16 to {out}: 0 B of ")
    assert said[-1] == f"exported checkpoint {ckpt} as bfloat16 to {out}"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_streamed_load_and_lora_show_their_progress_and_trained_params(tmp_path):
    """--model DIR on the tiered runtime reads its checkpoint with a progress line; a LoRA run
    logs the parameters it trains beside the total; masked data trains fewer tokens than a
    step processes, and the start line says which share."""
    from tierlm.data import train_bpe_tokenizer
    from tierlm.models import build_model
    from tierlm.models.testing import tiny_hf_configs
    from tierlm.train import Trainer

    src = tmp_path / "src"
    build_model(tiny_hf_configs(vocab_size=300)["llama_tied_gqa"], seed=0).save_pretrained(src)
    text = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    train_bpe_tokenizer([text], vocab_size=300).save_pretrained(src)
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}? Say it in words.",
                                        "completion": f" {2 * i}."}) + "\n" for i in range(60)))
    cfg = from_dict({
        "model": {"path": str(src)},
        "data": {"train": str(data), "seq_len": 16},
        "train": {"finetune": "lora", "max_steps": 1, "batch_size": 2, "eval_batches": 1,
                  "eval_every": 0, "sample_tokens": 0},
        "lora": {"rank": 4, "alpha": 8.0},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "precision": {"mode": "fp32"},
        "memory": {"offload_policy": "host"},
        "run": {"out": str(tmp_path / "run"), "device": "cpu", "seed": 5},
    })
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    assert f"load weights from {src}: 0 B of " in "\n".join(lines)
    (loaded,) = [ln for ln in lines if ln.startswith(f"load weights from {src}: ")
                 and " in 0:" in ln]
    (model,) = [ln for ln in lines if ln.startswith("model: ")]
    trained = trainer.n_trained
    assert 0 < trained < trainer.n_params
    assert f"{trainer.n_params / 1e6:.1f}M params ({trained / 1e6:.2f}M trained by " \
           "--finetune lora" in model
    (predicted,) = [ln for ln in lines if ln.startswith("plan: predicted step ")]
    share = float(predicted.split("tok/s (")[1].split("%")[0])
    assert 0 < share < 100
    rec = trainer.train_step()
    assert rec["trained_tokens_per_s"] < rec["tokens_per_s"]
    assert rec["predicted_trained_tokens_per_s"] == pytest.approx(
        rec["predicted_tokens_per_s"] * share / 100, rel=1e-2)  # the share is printed to 0.1%
    trainer.stepper.close()


def test_fp8_without_fp8_units_says_it_is_emulated():
    from tests.runtime_helpers import tiny_model
    from tierlm.precision import prepare_precision

    lines: list[str] = []
    prepare_precision(tiny_model("llama_untied"), PrecisionConfig(mode="fp8"), "fp8", CPU,
                      log=lines.append)
    (note,) = [ln for ln in lines if "emulated" in ln and "no speed-up" in ln]
    assert note.startswith("precision: fp8 is emulated (device cpu has no fp8 units)")


def test_report_leaves_out_an_empty_fetch_panel_and_plots_peak_rss(tmp_path):
    from tests.monitor.test_report import lines_by_gid, synthetic_run
    from tierlm.monitor.plots import build_figures
    from tierlm.monitor.report import load_run

    streamed = load_run(synthetic_run(tmp_path / "a", fp8=False))
    resident = load_run(synthetic_run(tmp_path / "b", fp8=False))
    for r in resident.steps:  # a plan that keeps everything on the device fetches nothing
        r["segments_fetched"] = r["segments_fetched_planned"] = 0
    titles = [ax.get_title() for ax in build_figures([streamed])["moves"].axes]
    assert any(t.startswith("Segments fetched") for t in titles)
    titles = [ax.get_title() for ax in build_figures([resident])["moves"].axes]
    assert not any(t.startswith("Segments fetched") for t in titles)

    memory = build_figures([streamed])["memory"]
    lines = lines_by_gid(memory)
    # the summary table's "process peak RSS" is the peak: the plot draws that, labelled so
    assert (lines["rss_peak_bytes/a"][:, 1] == 950).all()  # MiB
    labels = {ln.get_label() for ax in memory.axes for ln in ax.lines}
    assert {"process peak RSS", "process RSS at step end"} <= labels


def test_end_lines_without_a_plan_give_the_measured_rates():
    """The reference trainer has no plan: its run still ends with its step time and both
    tokens/s."""
    from tierlm.plan.predictions import prediction_lines

    rec = {"measured_step_time_s": 0.25, "measured_tokens_per_s": 512.0,
           "measured_trained_tokens_per_s": 256.0}
    assert prediction_lines(rec) == ["step time (median): measured 0.250 s",
                                     "tokens/s (median): measured 512",
                                     "trained tokens/s (median): measured 256"]
    rec.update(predicted_step_time_s=0.5, predicted_disk_bytes=2**20, measured_disk_bytes=2**21)
    assert prediction_lines(rec)[:2] == [
        "disk tier bytes: predicted 1.0 MiB, measured 2.0 MiB (2.00x)",
        "step time (median): predicted 0.500 s, measured 0.250 s (0.50x)"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_phases_are_bars_inside_the_live_view():
    """Evaluation and checkpoints during training are tasks of the live view's own bar (rich
    13, which pyproject allows, shows one Live display at a time); outside it a phase draws its
    own bar. Each finished phase leaves one line."""
    from tierlm.monitor.live import RichView

    screen = Terminal()
    progress = open_progress(print, stream=screen)
    left_open = progress.phase("load weights from src", 100, "bytes")  # never finished
    view = RichView(4, 0, screen, progress)  # takes the screen from the phase left open
    with progress.phase("eval (step 0)", 3, "batches") as phase:
        assert [t.description for t in view.bar.tasks] == ["train", "eval (step 0)"]
        for _ in range(3):
            phase.advance()
    assert [t.description for t in view.bar.tasks] == ["train"]
    view.close()
    left_open.close()
    with progress.phase("export float32 to hf", 2**20, "bytes") as phase:
        phase.advance(2**20)
    text = screen.getvalue()
    assert "eval (step 0): 3 batches in 0:00:00" in text
    assert "export float32 to hf: 1.00 MiB in 0:00:00" in text

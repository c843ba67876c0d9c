"""metrics.jsonl carries every monitored field on every run (None where a run cannot measure
it), the live view shows them on a terminal and as lines elsewhere, and a resumed run keeps its
windows and alert counts."""

import io
import math

import pytest
import torch

from tests.monitor_helpers import quiet, tiny_corpus, tiny_run_cfg
from tierlm.cli import main
from tierlm.config import ConfigError
from tierlm.memory.tiers import Link, Tier
from tierlm.monitor.alerts import DiskSlow
from tierlm.monitor.live import LineView, RichView, open_view
from tierlm.monitor.metrics import read_metrics
from tierlm.train import Trainer

# The fields issue H asks for, by what they show.
FIELDS = {
    "progress": ["step", "loss", "lr", "grad_norm", "skipped", "skipped_steps", "tokens_per_s",
                 "trained_tokens_per_s", "predicted_step_time_s", "predicted_tokens_per_s",
                 "predicted_trained_tokens_per_s"],
    "time": ["step_time_s", "compute_s", "transfer_wait_s", "update_wait_s"],
    "numerics": ["loss_var", "fp8_underflow_rate", "fp8_overflow_rate", "fp8_underflow_by_layer"],
    "memory": [*(f"{t}_{k}" for t in Tier for k in ("bytes", "peak_bytes", "step_peak_bytes")),
               "cuda_allocated_bytes", "cuda_max_allocated_bytes", "rss_bytes",
               "rss_peak_bytes"],
    "swaps": [*(f"{link}_{k}" for link in Link for k in ("bytes", "Bps", "bytes_per_s")),
              "segments_fetched", "segments_fetched_planned", "segments_fetched_per_s",
              "segments_over_plan", "pcie_h2d_util", "pcie_d2h_util"],
    "gpu": ["gpu_sm_clock_mhz", "gpu_max_sm_clock_mhz", "gpu_temp_c", "gpu_power_w",
            "gpu_throttle_reasons"],
    "alerts": ["alerts", "alert_messages"],
}
ALL_FIELDS = [k for keys in FIELDS.values() for k in keys]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def steps_of(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("policy", ["none", "disk"])
def test_metrics_have_every_field_and_a_clean_run_raises_no_alert(policy, corpus, tmp_path):
    # 22 steps: the loss-spike rule gives its first verdicts from step 20
    t = Trainer(tiny_run_cfg(tmp_path, corpus, policy=policy, max_steps=22), log=quiet)
    disk_slow = [d for d in t.monitor.alerts.detectors if isinstance(d, DiskSlow)]
    assert len(disk_slow) == (policy == "disk")
    for d in disk_slow:
        # this run's disk requests are tens of KiB, timed per request: when another test
        # takes the shared cores mid-run, a request's time is mostly waiting for a core, and
        # the run's rate fell 5x under its own start once in CI. The 5x rule is tested on
        # records (test_alerts); here the detector must run on the real numbers and stay
        # quiet short of a 50x fall, which a unit slip would exceed.
        d.ratio = 0.02
    t.train()
    t.stepper.close()
    recs = steps_of(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 23))
    for r in recs:
        assert set(ALL_FIELDS) <= r.keys(), set(ALL_FIELDS) - r.keys()
        assert r["alerts"] == [] and r["alert_messages"] == []
        # compute is timed by the stepper around its forward, backward and update work, apart
        # from the waits: disjoint pieces of the step, so together no longer than it
        parts = r["compute_s"] + r["transfer_wait_s"] + r["update_wait_s"]
        assert 0 < r["compute_s"] and parts <= r["step_time_s"]
        assert r["rss_peak_bytes"] >= r["rss_bytes"] > 0
        assert r["fp8_underflow_rate"] is None and r["fp8_underflow_by_layer"] is None
        if not torch.cuda.is_available():
            assert all(r[k] is None for k in FIELDS["gpu"])
            assert r["cuda_max_allocated_bytes"] is None and r["pcie_h2d_util"] is None
    assert recs[0]["loss_var"] is None
    losses = [r["loss"] for r in recs]
    window = losses[-10:]
    mean = sum(window) / 10
    assert recs[-1]["loss_var"] == pytest.approx(sum((x - mean) ** 2 for x in window) / 10)
    # What the parts leave of the step: the reference only loads batches around its compute
    # (under 1% of a run measured); the disk engine also lands gradients (D2H, disk writes) in
    # the step thread, which no part counts (8-11% of a run, up to 42% of one step, measured on
    # a shared 2-core box; 52% uncounted in one run beside two test workers). The bounds leave
    # room for a loaded machine; the reference's fails when its backward and update go untimed
    # (19% covered).
    covered = sum(r["compute_s"] + r["transfer_wait_s"] + r["update_wait_s"] for r in recs)
    assert covered >= (0.9 if policy == "none" else 0.3) * sum(r["step_time_s"] for r in recs)
    ledger = [k for k in FIELDS["memory"] + FIELDS["swaps"]
              if k.startswith((*map(str, Tier), *map(str, Link), "segments_"))]
    if policy == "none":  # the reference trainer has no ledger and moves nothing
        assert all(r[k] is None for r in recs for k in ledger)
        assert all(r["transfer_wait_s"] == 0.0 for r in recs)
        return
    for r in recs:
        # with no state on the device every part lies inside the forward and backward sweep
        assert r["compute_s"] + r["transfer_wait_s"] + r["update_wait_s"] <= r["sweep_s"]
        assert r["disk_peak_bytes"] > 0 and r["device_step_peak_bytes"] > 0
        assert r["h2d_bytes_per_s"] == pytest.approx(r["h2d_bytes"] / r["step_time_s"])
        assert r["disk_read_bytes_per_s"] > 0 and r["disk_write_bytes_per_s"] > 0
        assert r["segments_fetched"] == r["segments_fetched_planned"] > 0
        assert r["segments_over_plan"] == {}


def _record(step=7, **kw):
    rec = {"step": step, "loss": 2.5, "loss_var": 0.01, "tokens_per_s": 1234.0,
           "step_time_s": 0.6, "compute_s": 0.3, "transfer_wait_s": 0.15, "update_wait_s": 0.05,
           "device_peak_bytes": 3 * 2**30, "host_peak_bytes": 5 * 2**30,
           "disk_peak_bytes": 20 * 2**30, "rss_peak_bytes": 6 * 2**30, "skipped_steps": 1,
           "segments_fetched": 12, "segments_fetched_planned": 12}
    links = (Link.H2D, Link.D2H, Link.DISK_READ, Link.DISK_WRITE)
    for link, rate in zip(links, (2e9, 1e9, 1.5e9, 1.2e9), strict=True):
        rec[f"{link}_bytes"] = int(rate * rec["step_time_s"])
        rec[f"{link}_bytes_per_s"] = rate
    rec.update(kw)
    return rec


def test_line_view_prints_every_n_steps_with_all_parts():
    out = io.StringIO()
    view = open_view(20, 0, stream=out, every=5)
    assert isinstance(view, LineView)
    evals = {"step": 5, "eval_loss": 2.75}
    for step in range(1, 11):
        view.update(_record(step), evals, {"loss_spike": 0, "thrashing": 1})
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/20", "5/20", "10/20"]
    line = lines[-1]
    for part in ("loss 2.5000", "var 0.01", "eval 2.7500 (step 5)", "1,234 tok/s",
                 "step 0.600s = compute 0.300 + transfer wait 0.150 + update wait 0.050 + other "
                 "0.100",
                 "device 3.00 GiB", "host 5.00 GiB", "disk 20.00 GiB", "process RSS 6.00 GiB",
                 "H2D 2.00 GB/s", "D2H 1.00 GB/s", "disk read 1.50 GB/s", "disk write 1.20 GB/s",
                 "fetched 12/step (plan 12)", "skipped 1", "alerts 1 (thrashing 1)", "eta 0:00:"):
        assert part in line, part


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_rich_view_draws_the_panel_on_a_terminal():
    term = FakeTerminal()
    view = open_view(20, 0, stream=term)
    assert isinstance(view, RichView)
    view.log("step 3: alert thrashing: block.1 fetched 3x (plan 2x)")
    view.update(_record(7), {"step": 5, "eval_loss": 2.75}, {"thrashing": 1})
    view.show_eval({"step": 8, "eval_loss": 2.5})
    view.close()
    text = term.getvalue()
    for part in ("train", "7/20", "2.5000  var 0.01", "transfer wait 0.150", "device 3.00 GiB",
                 "disk write 1.20 GB/s", "alerts 1 (thrashing 1)", "alert thrashing",
                 "eval 2.5000 (step 8)"):
        assert part in text, part


def test_resume_keeps_the_alert_counts_and_the_loss_window(corpus, tmp_path):
    first = Trainer(tiny_run_cfg(tmp_path, corpus, max_steps=6, save_every=3), log=quiet)
    step, victim = first.stepper.step, first.stepper.params[0]

    def poisoned(b, lr):
        handle = victim.register_hook(lambda g: torch.full_like(g, math.inf))
        try:
            return step(b, lr)
        finally:
            handle.remove()

    first.stepper.step = lambda b, lr: (poisoned if first.step == 1 else step)(b, lr)
    first.train(until_step=3)
    assert first.monitor.alerts.counts["non_finite"] == 1
    cfg = tiny_run_cfg(tmp_path, corpus, max_steps=6, save_every=3)
    cfg.run.resume = str(tmp_path)
    second = Trainer(cfg, log=quiet)
    assert second.monitor.alerts.counts["non_finite"] == 1  # replayed, not logged again
    second.train()
    recs = steps_of(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    # the window continued across the resume: step 4's variance is that of steps 1-4 (the
    # poisoned step's loss is finite; only its gradient was not)
    losses = [r["loss"] for r in recs]
    for n in (4, 6):
        mean = sum(losses[:n]) / n
        assert recs[n - 1]["loss_var"] == pytest.approx(
            sum((x - mean) ** 2 for x in losses[:n]) / n, rel=1e-12)


def test_tensorboard_flag_writes_events_or_fails_with_the_install_hint(corpus, tmp_path, capsys):
    cfg = tiny_run_cfg(tmp_path / "run", corpus, max_steps=2)
    cfg.monitor.tensorboard = True
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"pip install 'tierlm\[tensorboard\]'"):
            Trainer(cfg, log=quiet)
        rc = main(["train", "--config", "configs/tiny.yaml", "--out", str(tmp_path / "cli"),
                   "--monitor.tensorboard", "true"])
        assert rc == 2 and "--tensorboard needs the tensorboard package" in capsys.readouterr().err
        return
    Trainer(cfg, log=quiet).train()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


SPECULATION = ["speculated_segments", "speculation_kept", "speculation_redone",
               "speculation_dropped", "speculation_redo_disk_bytes"]


@pytest.mark.parametrize("speculative", ["on", "off"])
def test_speculation_fields_and_the_redo_line(speculative, corpus, tmp_path, capsys):
    """A disk-tier run with speculative updates and a clip that always binds: every step's
    record says its speculations were redone, and the log says so once, at the first; without
    the option the fields are absent."""
    cfg = tiny_run_cfg(tmp_path, corpus, policy="disk", max_steps=3)
    cfg.memory.speculative_update = speculative
    cfg.optim.grad_clip = 1e-6
    t = Trainer(cfg, log=quiet)
    t.train()
    t.stepper.close()
    lines = capsys.readouterr().out.split("\n")  # the monitor's view logs the run's lines
    recs = steps_of(tmp_path)
    assert len(recs) == 3
    if speculative == "off":
        assert not any(k in r for r in recs for k in SPECULATION)
        assert not [line for line in lines if "speculative" in line]
        return
    n = len(t.stepper.engine.states)  # all on disk
    for r in recs:
        assert [r[k] for k in SPECULATION[:4]] == [n, 0, n, 0]
        assert r["speculation_redo_disk_bytes"] > 0
    said = [line for line in lines if "speculative disk-tier updates were redone" in line]
    assert len(said) == 1 and said[0].startswith("step 1: gradient clipping was active")


def test_the_speculation_notice_names_the_flag_once_most_steps_redo():
    from tierlm.monitor.probes import SpeculationNotice

    def rec(redone):
        return {"speculated_segments": 4, "speculation_redone": 4 if redone else 0,
                "speculation_kept": 0 if redone else 4, "speculation_redo_disk_bytes": 1 << 20}

    notice = SpeculationNotice(window=10)
    said = [notice.check(rec(i % 3 != 0)) for i in range(30)]  # two steps in three redo
    assert said[0] is None and "were redone" in said[1]  # the first redo, once
    assert [i for i, s in enumerate(said) if s] == [1, 9]
    assert said[9].startswith("speculative updates were redone on 6 of 10 steps") \
        and said[9].endswith("pass --speculative-update off")
    # one in three: never most of them
    notice = SpeculationNotice(window=10)
    said = [notice.check(rec(i % 3 == 0)) for i in range(30)]
    assert [i for i, s in enumerate(said) if s] == [0]
    # nothing speculated: nothing counted
    assert SpeculationNotice(window=1).check({"step": 1}) is None

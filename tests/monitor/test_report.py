"""`tierlm report`: every PNG is written, decodes, is not blank, and its figure plots exactly the
points the metrics hold; the summary shows planned vs measured peaks; two runs overlay."""

import json

import matplotlib.image
import numpy as np
import pytest
import yaml

from tests.monitor_helpers import quiet, tiny_corpus, tiny_run_cfg
from tierlm.cli import main
from tierlm.memory.tiers import Link, Tier
from tierlm.monitor.plots import build_figures
from tierlm.monitor.report import load_run, summary_table
from tierlm.train import Trainer

N_STEPS, EVAL_STEPS = 30, [0, 10, 20, 30]
LAYERS = ["block.0.attn.q_proj", "block.0.mlp.up_proj", "block.1.attn.q_proj"]
MiB = 2**20


def synthetic_run(path, *, fp8=True, planned=True, seed=0):
    """A run directory with known metrics: 30 steps, 4 evaluations, budgets in config.yaml, the
    planner's prediction record and, optionally, fp8 statistics for 3 layers."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(
        {"memory": {"device_budget": "64MiB", "host_budget": "256MiB"}}))
    recs = []
    for s in EVAL_STEPS[:1]:
        recs.append({"step": s, "eval_loss": 6.0, "eval_ppl": float(np.exp(6.0))})
    for s in range(1, N_STEPS + 1):
        rec = {"step": s, "loss": 6.0 - 0.1 * s + 0.05 * rng.standard_normal(), "lr": 1e-3,
               "grad_norm": 1.0, "skipped": s == 7, "skipped_steps": int(s >= 7),
               "tokens_per_s": 1000.0, "step_time_s": 0.5, "compute_s": 0.3,
               "transfer_wait_s": 0.15, "update_wait_s": 0.05, "rss_bytes": 900 * MiB,
               "rss_peak_bytes": 950 * MiB, "cuda_max_allocated_bytes": None,
               "segments_fetched": 12 + (s == 15), "segments_fetched_planned": 12,
               "alerts": ["thrashing"] if s == 15 else [],
               "alert_messages": ["thrashing: block.1 2x (plan 1x)"] if s == 15 else []}
        for tier, mib in ((Tier.DEVICE, 40), (Tier.HOST, 200), (Tier.DISK, 0)):
            rec[f"{tier}_step_peak_bytes"] = rec[f"{tier}_peak_bytes"] = mib * MiB
        for link, rate in zip(Link, (2e9, 1e9, 0.0, 0.0), strict=False):
            rec[f"{link}_bytes_per_s"] = rate * (1 + 0.1 * rng.standard_normal())
        if fp8:
            rec["fp8_underflow_by_layer"] = {n: 0.001 * (i + 1) * s for i, n in enumerate(LAYERS)}
        recs.append(rec)
        if s in EVAL_STEPS:
            recs.append({"step": s, "eval_loss": 6.0 - 0.09 * s, "eval_ppl": 1.0})
    if planned:
        recs.append({"step": N_STEPS, "predicted_device_peak_bytes": 48 * MiB,
                     "predicted_host_peak_bytes": 180 * MiB, "predicted_disk_bytes": 0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def lines_by_gid(fig):
    return {ln.get_gid(): ln.get_xydata() for ax in fig.axes for ln in ax.lines if ln.get_gid()}


def test_figures_plot_exactly_the_recorded_points(tmp_path):
    run = load_run(synthetic_run(tmp_path / "a"))
    figs = build_figures([run])
    assert set(figs) == {"loss", "step_time", "memory", "moves", "fp8_underflow"}

    loss = lines_by_gid(figs["loss"])
    assert len(loss["loss/a"]) == N_STEPS and len(loss["eval/a"]) == len(EVAL_STEPS)
    np.testing.assert_allclose(loss["loss/a"][:, 1], [r["loss"] for r in run.steps])
    assert list(loss["eval/a"][:, 0]) == EVAL_STEPS

    stacked = lines_by_gid(figs["step_time"])
    # each line is the top of its layer: compute, + transfer wait, + update wait
    for key, top in (("compute_s", 0.3), ("transfer_wait_s", 0.45), ("update_wait_s", 0.5)):
        assert len(stacked[f"{key}/a"]) == N_STEPS
        np.testing.assert_allclose(stacked[f"{key}/a"][:, 1], top)

    memory_fig = figs["memory"]
    mem = lines_by_gid(memory_fig)
    assert len(mem["device_step_peak_bytes/a"]) == N_STEPS
    assert "disk_step_peak_bytes/a" not in mem  # no disk tier in this run: no panel
    np.testing.assert_allclose(mem["device_step_peak_bytes/a"][:, 1], 40)  # MiB axis
    device_ax = next(ax for ax in memory_fig.axes if ax.get_title().startswith("Device"))
    flat = {tuple(ln.get_ydata()) for ln in device_ax.lines if not ln.get_gid()}
    assert (64.0, 64.0) in flat and (48.0, 48.0) in flat  # the budget and the planned peak

    moves = lines_by_gid(figs["moves"])
    assert len(moves["h2d/a"]) == len(moves["d2h/a"]) == N_STEPS
    for link in ("h2d", "d2h"):  # in GB/s
        np.testing.assert_allclose(moves[f"{link}/a"][:, 1],
                                   [r[f"{link}_bytes_per_s"] / 1e9 for r in run.steps])
    assert "disk_read/a" not in moves  # a link that moved nothing is not drawn
    assert len(moves["segments_fetched/a"]) == N_STEPS
    assert moves["segments_fetched/a"][14, 1] == 13

    heat = next(im for ax in figs["fp8_underflow"].axes for im in ax.images)
    assert heat.get_gid() == "fp8_underflow/a"
    grid = heat.get_array()
    assert grid.shape == (len(LAYERS), N_STEPS)
    np.testing.assert_allclose(grid[2, 9], 100 * 0.003 * 10)  # layer 3 at step 10, in %


def test_report_writes_readable_pngs_and_the_summary(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "a")
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report"
    assert f"report: {out / 'report.md'}" in capsys.readouterr().out
    for name in ("loss", "step_time", "memory", "moves", "fp8_underflow"):
        png = out / f"{name}.png"
        img = matplotlib.image.imread(png)
        assert img.shape[0] > 300 and img.shape[1] > 800, name
        assert img[..., :3].std() > 0.05, f"{name}.png is blank"
    md = (out / "report.md").read_text()
    for name in ("loss", "step_time", "memory", "moves", "fp8_underflow"):
        assert f"![{name}]({name}.png)" in md
    assert "| peak device bytes (planned / measured) | 48.00 MiB / 40.00 MiB, 0.83x " \
           "(budget 64.00 MiB) |" in md
    assert "| skipped steps | 1 |" in md and "| alerts | thrashing 1 |" in md
    assert ("| step time, median s (compute / transfer wait / update wait) | 0.500 "
            "(0.300 / 0.150 / 0.050) |") in md
    assert "a, step 15: **thrashing**: thrashing: block.1 2x (plan 1x)" in md


def test_summary_shows_measured_only_without_a_plan(tmp_path):
    run = load_run(synthetic_run(tmp_path / "a", planned=False, fp8=False))
    table = summary_table([run])
    assert "| peak device bytes | 40.00 MiB (budget 64.00 MiB) |" in table
    assert "planned" not in table
    assert "fp8_underflow" not in build_figures([run])


def test_two_runs_overlay(tmp_path):
    a = synthetic_run(tmp_path / "a")
    b = synthetic_run(tmp_path / "b", fp8=False, seed=1)
    assert main(["report", str(a), str(b)]) == 0
    out = a / "report-vs-b"
    assert (out / "loss.png").stat().st_size > 0
    runs = [load_run(a), load_run(b)]
    figs = build_figures(runs)
    loss = lines_by_gid(figs["loss"])
    for run in runs:  # each run's own losses (the two differ: other seeds)
        np.testing.assert_allclose(loss[f"loss/{run.name}"][:, 1], [r["loss"] for r in run.steps])
    assert len(figs["step_time"].axes) == 2  # one stacked panel per run
    assert {"h2d/a", "h2d/b"} <= lines_by_gid(figs["moves"]).keys()
    assert "| | a | b |" in (out / "report.md").read_text()


def test_report_of_a_real_run(tmp_path_factory, tmp_path):
    corpus = tiny_corpus(tmp_path_factory.mktemp("corpus"))
    Trainer(tiny_run_cfg(tmp_path, corpus, policy="host", max_steps=5, eval_every=2),
            log=quiet).train()
    run = load_run(tmp_path)
    figs = build_figures([run])
    losses = lines_by_gid(figs["loss"])[f"loss/{tmp_path.name}"]
    np.testing.assert_allclose(losses, [(r["step"], r["loss"]) for r in run.steps])
    assert len(losses) == 5
    assert len(lines_by_gid(figs["loss"])[f"eval/{tmp_path.name}"]) == 4  # steps 0, 2, 4, 5
    assert len(lines_by_gid(figs["memory"])[f"host_step_peak_bytes/{tmp_path.name}"]) == 5
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "moves.png").stat().st_size > 0


@pytest.mark.parametrize("make, says", [("missing", "no metrics.jsonl"),
                                         ("empty", "no training steps")])
def test_report_refuses_a_directory_without_steps(make, says, tmp_path, capsys):
    if make == "empty":
        (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 5.0}\n')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tierlm: error:" in err and says in err

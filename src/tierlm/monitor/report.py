"""`tierlm report RUN_DIR [RUN_DIR2]`: PNG plots and a report.md with a summary table.

One run: RUN_DIR/report/. Two runs: the plots overlay them, written to
RUN_DIR/report-vs-<second run's name>/ (or `--out`). The summary shows, per run: steps,
final train and held-out loss, tokens/s, the step-time split, skipped steps, alerts, and the
peak bytes per tier measured by the ledger against the planner's prediction when the run has one
(a record with `predicted_<tier>_peak_bytes`) and the budget when one was set. A run traced with
`--monitor.trace_step` (RUN_DIR/trace.json) also gets the step's lanes, measured and predicted,
and its placement map.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tierlm.config import ConfigError, parse_bytes
from tierlm.memory.tiers import Tier
from tierlm.monitor.live import fmt_bytes
from tierlm.monitor.metrics import read_metrics
from tierlm.monitor.plots import build_figures
from tierlm.monitor.trace_plots import placement_figure, trace_figure

DPI = 110


class ReportError(ValueError):
    """The directory is not a run, or its metrics hold no training steps."""


@dataclass
class Run:
    name: str
    path: Path
    steps: list[dict[str, Any]]  # one record per optimizer step (has "loss")
    evals: list[dict[str, Any]]  # held-out evaluations (has "eval_loss")
    other: list[dict[str, Any]]  # anything else (the planner's predictions, events)
    budgets: dict[str, float] = field(default_factory=dict)  # tier -> bytes, from config.yaml
    planned: dict[str, float] = field(default_factory=dict)  # tier -> predicted peak bytes
    trace: dict[str, Any] | None = None  # RUN_DIR/trace.json (--monitor.trace_step)


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl; is it a run directory (--out of a run)?")
    recs = read_metrics(metrics)
    steps = [r for r in recs if "loss" in r and "step" in r]
    if not steps:
        raise ReportError(f"{metrics}: no training steps recorded yet")
    # A resumed run rewrites the steps after its checkpoint: the last record of a step wins.
    steps = list({r["step"]: r for r in steps}.values())
    evals = list({r["step"]: r for r in recs if "eval_loss" in r}.values())
    other = [r for r in recs if "loss" not in r and "eval_loss" not in r]
    run = Run(name=path.resolve().name, path=path, steps=steps, evals=evals, other=other)
    cfg_file = path / "config.yaml"
    if cfg_file.is_file():
        mem = (yaml.safe_load(cfg_file.read_text(encoding="utf-8")) or {}).get("memory") or {}
        for tier, key in ((Tier.DEVICE, "device_budget"), (Tier.HOST, "host_budget"),
                          (Tier.DISK, "disk_budget")):
            if mem.get(key):
                try:
                    run.budgets[str(tier)] = parse_bytes(mem[key])
                except ConfigError:
                    pass
    trace_file = path / "trace.json"
    if trace_file.is_file():
        try:
            run.trace = json.loads(trace_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ReportError(
                f"{trace_file}: not JSON ({exc}); delete it or trace the run again"
            ) from None
    for rec in other:
        for tier in Tier:
            value = rec.get(f"predicted_{tier}_peak_bytes", rec.get(f"predicted_{tier}_bytes"))
            if value is not None:
                run.planned[str(tier)] = value
    return run


def _median(run: Run, key: str) -> float | None:
    vals = [r[key] for r in run.steps if isinstance(r.get(key), int | float)]
    return statistics.median(vals) if vals else None


def _peak(run: Run, tier: Tier) -> float | None:
    vals = [r[f"{tier}_peak_bytes"] for r in run.steps
            if isinstance(r.get(f"{tier}_peak_bytes"), int | float)]
    return max(vals) if vals else None


def alert_counts(run: Run) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in run.steps:
        for name in r.get("alerts") or []:
            counts[name] = counts.get(name, 0) + 1
    return counts


def summary_rows(run: Run) -> list[tuple[str, str]]:
    last = run.steps[-1]
    rows = [("steps", f"{last['step']}")]
    loss = last.get("loss")
    rows.append(("final train loss", "-" if loss is None else f"{loss:.4f}"))
    if run.evals:
        e = run.evals[-1]
        rows.append(("final held-out loss (perplexity)",
                     f"{e['eval_loss']:.4f} ({e['eval_ppl']:.2f}) at step {e['step']}"))
    for key, label in (("tokens_per_s", "tokens/s (median)"),
                       ("trained_tokens_per_s", "trained tokens/s (median)")):
        tps, planned = _median(run, key), _median(run, f"predicted_{key}")
        if tps is None and key != "tokens_per_s":
            continue  # a run recorded before trained tokens/s was
        text = "-" if tps is None else f"{tps:,.0f}"
        rows.append((label, text + ("" if planned is None else f" (plan {planned:,.0f})")))
    parts = [_median(run, k) for k in ("step_time_s", "compute_s", "transfer_wait_s",
                                       "update_wait_s")]
    if parts[0] is not None:
        split = " / ".join("-" if p is None else f"{p:.3f}" for p in parts[1:])
        rows.append(("step time, median s (compute / transfer wait / update wait)",
                     f"{parts[0]:.3f} ({split})"))
    rows.append(("skipped steps", str(last.get("skipped_steps",
                                               sum(1 for r in run.steps if r.get("skipped"))))))
    counts = alert_counts(run)
    rows.append(("alerts", ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"))
    for tier in Tier:
        measured, planned = _peak(run, tier), run.planned.get(str(tier))
        budget = run.budgets.get(str(tier))
        if not measured and not planned:
            continue  # this run used no such tier
        label = f"peak {tier} bytes"
        text = fmt_bytes(measured)
        if planned is not None:
            label += " (planned / measured)"
            ratio = f", {measured / planned:.2f}x" if measured and planned else ""
            text = f"{fmt_bytes(planned)} / {fmt_bytes(measured)}{ratio}"
        if budget is not None:
            text += f" (budget {fmt_bytes(budget)})"
        rows.append((label, text))
    cuda = [r["cuda_max_allocated_bytes"] for r in run.steps
            if r.get("cuda_max_allocated_bytes") is not None]
    if cuda:
        rows.append(("CUDA max allocated", fmt_bytes(max(cuda))))
    reserved = [r["cuda_max_reserved_bytes"] for r in run.steps
                if r.get("cuda_max_reserved_bytes") is not None]
    if reserved:  # reserved beyond allocated: the allocator's cache and fragmentation
        rows.append(("CUDA max reserved", fmt_bytes(max(reserved))))
    retries = [r["cuda_alloc_retries"] for r in run.steps
               if r.get("cuda_alloc_retries") is not None]
    if retries:
        rows.append(("CUDA allocator retries", str(max(retries))))
    rss = [r["rss_peak_bytes"] for r in run.steps if r.get("rss_peak_bytes")]
    if rss:
        rows.append(("process peak RSS", fmt_bytes(max(rss))))
    other = (run.trace or {}).get("otherData") or {}
    if other.get("step") is not None:
        measured = (other.get("measured_s") or {}).get("step_time_s")
        predicted = (other.get("predicted_times_s") or {}).get("step")
        rows.append(("traced step: measured / predicted s", f"{other['step']}: "
                     + " / ".join("-" if v is None else f"{v:.3f}" for v in (measured, predicted))))
    return rows


def summary_table(runs: list[Run]) -> str:
    tables = [dict(summary_rows(r)) for r in runs]
    labels = list(dict.fromkeys(k for t in tables for k in t))
    lines = ["| | " + " | ".join(r.name for r in runs) + " |",
             "| --- |" + " --- |" * len(runs)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(t.get(label, "-") for t in tables) + " |")
    return "\n".join(lines)


_CAPTIONS = {
    "loss": "Training loss per step and held-out loss at each evaluation; red dotted lines mark "
            "steps that raised an alert, red crosses skipped steps.",
    "step_time": "Where each step's time went: compute, waiting for weights to arrive "
                 "(transfer wait), waiting for the previous step's background optimizer update "
                 "(update wait).",
    "memory": "Bytes each tier held (the peak within each step, from the ledger) against the "
              "budget and the planner's predicted peak; the process panel shows the resident "
              "set, its peak so far (the summary's number) and at each step's end (and CUDA's "
              "allocated bytes on a GPU).",
    "moves": "Swap rates: bytes moved per second of step on each link, and segments fetched to "
             "the device per step against the schedule's plan (left out when the plan streams "
             "nothing).",
    "fp8_underflow": "Share of values that underflowed to zero when cast to fp8, per layer.",
    "trace": "The traced step (--monitor.trace_step, RUN_DIR/trace.json; open it in "
             "ui.perfetto.dev for names and sizes): measured lanes above, the planner's "
             "predicted lanes below, each on its own time axis. Compute is the step less its "
             "waits for weights and for the previous update (the wait lane); H2D/D2H are the "
             "store's copies, disk read/write one bar per request, cpu update the optimizer per "
             "segment (the step's own updates run after its sweep, behind the next forward). A "
             "lane with work in flight at once is split into numbered rows. The predicted lanes "
             "are the plan's simulated step: the planner's replay of the engine's operations "
             "on the profile's simulated GPU, its steady-state step op by op.",
    "placement": "Where each segment's state lives: bytes per tier and tensor class (compute "
                 "weights on the device for resident segments; streamed ones visit the device "
                 "only while their action runs).",
}


def trace_figures(runs: list[Run]) -> dict[str, Any]:
    figs = {}
    for i, run in enumerate(runs):
        if run.trace is None:
            continue
        suffix = "" if len(runs) == 1 else f"_{i + 1}"
        other = run.trace.get("otherData") or {}
        figs[f"trace{suffix}"] = trace_figure(
            run.trace, f"{run.name}: step {other.get('step', '?')}")
        if other.get("placement"):
            figs[f"placement{suffix}"] = placement_figure(
                other["placement"], f"{run.name}: placement")
    return figs


def alert_section(runs: list[Run]) -> str:
    lines = []
    for run in runs:
        for r in run.steps:
            for name, msg in zip(r.get("alerts") or [], r.get("alert_messages") or [],
                                 strict=False):
                lines.append(f"- {run.name}, step {r['step']}: **{name}**: {msg}")
    if not lines:
        return "No alerts."
    if len(lines) > 50:
        lines = lines[:50] + [f"- ... and {len(lines) - 50} more (see metrics.jsonl)"]
    return "\n".join(lines)


def write_report(runs: list[Run], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = {**build_figures(runs), **trace_figures(runs)}
    title = (f"Run report: {runs[0].name}" if len(runs) == 1
             else "Run comparison: " + " vs ".join(r.name for r in runs))
    md = [f"# {title}", "", "Runs: " + ", ".join(f"`{r.path}`" for r in runs), "",
          summary_table(runs), ""]
    for name, fig in figs.items():
        fig.savefig(out_dir / f"{name}.png", dpi=DPI)
        caption = _CAPTIONS.get(name) or _CAPTIONS[name.rsplit("_", 1)[0]]
        md += [f"## {name.replace('_', ' ').capitalize()}", "", caption, "",
               f"![{name}]({name}.png)", ""]
    md += ["## Alerts", "", alert_section(runs), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path


def default_out_dir(runs: list[Run]) -> Path:
    if len(runs) == 1:
        return runs[0].path / "report"
    return runs[0].path / f"report-vs-{runs[1].name}"


def report_main(run_dirs: list[str], out: str | None = None) -> int:
    """The `tierlm report` command: returns the exit status."""
    try:
        if not 1 <= len(run_dirs) <= 2:
            raise ReportError("report: give one run directory, or two to compare")
        runs = [load_run(d) for d in run_dirs]
        if len(runs) == 2 and runs[0].name == runs[1].name:
            runs[1].name = f"{runs[1].name} (2)"
        path = write_report(runs, Path(out) if out else default_out_dir(runs))
    except ReportError as exc:
        print(f"tierlm: error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0

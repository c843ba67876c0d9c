"""The report's figures, built from runs' metrics (one run, or two overlaid).

Every plotted series is a Line2D whose gid names it (`loss/<run>`, `eval/<run>`, ...), so tests
and tools can read the data back from the figure. Figures are `matplotlib.figure.Figure`
objects (no pyplot global state); `report.py` saves them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from tierlm.memory.tiers import Link, Tier

LINK_LABEL = {Link.H2D: "H2D", Link.D2H: "D2H", Link.DISK_READ: "disk read",
              Link.DISK_WRITE: "disk write", Link.NET_SEND: "net send",
              Link.NET_RECV: "net recv"}
TIER_COLOR = {Tier.DEVICE: "tab:blue", Tier.HOST: "tab:orange", Tier.DISK: "tab:green"}
LINK_COLOR = {Link.H2D: "tab:blue", Link.D2H: "tab:orange", Link.DISK_READ: "tab:green",
              Link.DISK_WRITE: "tab:red", Link.NET_SEND: "tab:purple",
              Link.NET_RECV: "tab:brown"}
RUN_STYLE = ["-", "--"]  # run A solid, run B dashed
RUN_COLOR = ["tab:blue", "tab:orange"]
RUN_MARKER = ["o", "x"]
WIDTH_IN = 10


def series(recs: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`, skipping records where it is missing or null."""
    pts = [(r["step"], r[key]) for r in recs
           if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
    if not pts:
        return np.empty(0), np.empty(0)
    x, y = zip(*pts, strict=True)
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float)


def has(runs: list[Any], key: str) -> bool:
    return any(series(r.steps, key)[0].size for r in runs)


def byte_unit(max_bytes: float) -> tuple[str, float]:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return unit, scale
    return "B", 1.0


def rate_unit(max_bps: float) -> tuple[str, float]:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if max_bps >= scale:
            return unit, scale
    return "B/s", 1.0


def _line(ax, x, y, gid: str, **kw):
    (line,) = ax.plot(x, y, **kw)
    line.set_gid(gid)
    return line


def robust_top(values: np.ndarray) -> float | None:
    """An upper y-limit that keeps outliers (the first step's warm-up, a stall) from flattening
    everything else: None (autoscale) unless the maximum is over 3x the 90th percentile."""
    if values.size < 5:
        return None
    q = float(np.percentile(values, 90))
    return 1.6 * q if q > 0 and values.max() > 3 * q else None


def _mark_off_scale(ax, x: np.ndarray, y: np.ndarray, top: float, unit: str) -> None:
    for xi, yi in zip(x, y, strict=True):
        if yi > top:
            ax.annotate(f"step {xi:.0f}: {yi:.3g} {unit} (off scale)", (xi, top),
                        xytext=(14, -14), textcoords="offset points", fontsize="small",
                        color="0.3", arrowprops={"arrowstyle": "->", "color": "0.3"})


def _title(runs: list[Any], what: str) -> str:
    return f"{what}: " + " vs ".join(r.name for r in runs)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def loss_figure(runs: list[Any]) -> Figure:
    fig = Figure(figsize=(WIDTH_IN, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        x, y = series(run.steps, "loss")
        tag = f" ({run.name})" if len(runs) > 1 else ""
        _line(ax, x, y, f"loss/{run.name}", color=RUN_COLOR[i], lw=1.2, alpha=0.85,
              label=f"train loss{tag}")
        ex, ey = series(run.evals, "eval_loss")
        if ex.size:
            _line(ax, ex, ey, f"eval/{run.name}", color=RUN_COLOR[i], ls="--", marker="o",
                  ms=6, mec="black", mew=0.6, label=f"held-out loss{tag}")
        # one run: red marks trouble; two runs: each run's marks in its own color
        mark = "red" if len(runs) == 1 else RUN_COLOR[i]
        skipped = [r["step"] for r in run.steps if r.get("skipped")]
        if skipped:
            ax.plot(skipped, [0] * len(skipped), RUN_MARKER[i], color=mark, ms=8,
                    clip_on=False, transform=ax.get_xaxis_transform(),
                    label=f"skipped steps{tag}")
        alerted = [r["step"] for r in run.steps if r.get("alerts")]
        for k, s in enumerate(alerted):
            ax.axvline(s, color=mark, ls=":", lw=1.2, alpha=0.8,
                       label=f"alert{tag}" if k == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.set_title(_title(runs, "Loss"))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return fig


def step_time_figure(runs: list[Any]) -> Figure:
    """Stacked: compute, then transfer wait, then update wait; one panel per run."""
    fig = Figure(figsize=(WIDTH_IN, 3.6 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    parts = [("compute_s", "compute", "tab:blue"),
             ("transfer_wait_s", "transfer wait", "tab:orange"),
             ("update_wait_s", "update wait", "tab:red")]
    for ax, run in zip(axes, runs, strict=True):
        x, _ = series(run.steps, "step_time_s")
        base = np.zeros_like(x)
        for key, label, color in parts:
            by_step = {r["step"]: r.get(key) or 0.0 for r in run.steps}
            top = base + np.asarray([by_step[s] for s in x])
            ax.fill_between(x, base, top, color=color, alpha=0.55, lw=0, label=label)
            _line(ax, x, top, f"{key}/{run.name}", color=color, lw=0.8)
            base = top
        cap = robust_top(base)
        if cap is not None:
            ax.set_ylim(top=cap)
            _mark_off_scale(ax, x, base, cap, "s")
        ax.set_ylabel("seconds per step")
        ax.set_title(f"Step time, stacked: {run.name}")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("step")
    return fig


def _budget_bytes(run: Any, tier: Tier) -> float | None:
    return run.budgets.get(str(tier))


def memory_figure(runs: list[Any]) -> Figure:
    """One panel per tier with data (the step's peak bytes, the budget and the planner's
    prediction as horizontal lines), then the process panel (RSS; CUDA allocated)."""
    panels: list[tuple[str, list[tuple[str, str]]]] = [
        (f"{t} tier", [(f"{t}_step_peak_bytes", f"{t} step peak")])
        for t in Tier if has(runs, f"{t}_step_peak_bytes")
        and any(series(r.steps, f"{t}_step_peak_bytes")[1].max(initial=0) > 0 for r in runs)
    ]
    # the peak is the summary table's number; the RSS at each step's end shows what was freed
    process = [("rss_peak_bytes", "process peak RSS"), ("rss_bytes", "process RSS at step end")]
    if has(runs, "cuda_max_allocated_bytes"):
        process.append(("cuda_max_allocated_bytes", "CUDA max allocated"))
    panels.append(("process", process))
    fig = Figure(figsize=(WIDTH_IN, 2.9 * len(panels) + 0.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, keys) in zip(axes, panels, strict=True):
        tier = next((t for t in Tier if title.startswith(str(t))), None)
        refs: list[float] = []
        for run in runs:
            refs += [v for v in (_budget_bytes(run, tier), run.planned.get(str(tier)))
                     if tier is not None and v is not None]
        top = max([*refs, *(series(r.steps, k)[1].max(initial=0) for r in runs
                            for k, _ in keys)], default=0)
        unit, scale = byte_unit(top)
        for i, run in enumerate(runs):
            tag = f" ({run.name})" if len(runs) > 1 else ""
            for j, (key, label) in enumerate(keys):
                x, y = series(run.steps, key)
                color = (TIER_COLOR[tier] if tier is not None
                         else ["0.25", "0.6", "tab:purple"][j])
                _line(ax, x, y / scale, f"{key}/{run.name}", color=color, ls=RUN_STYLE[i],
                      lw=1.6, label=label + tag)
            if tier is None:
                continue
            budget = _budget_bytes(run, tier)
            if budget is not None:
                ax.axhline(budget / scale, color="black", ls=RUN_STYLE[i], lw=1.2,
                           label=f"{tier} budget{tag}")
            planned = run.planned.get(str(tier))
            if planned is not None:
                ax.axhline(planned / scale, color="tab:gray", ls=":", lw=1.5,
                           label=f"{tier} planned peak{tag}")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0, top=top / scale * 1.15 if top else 1)
        ax.set_title(title.capitalize() + (": bytes held (peak within each step)"
                                           if tier is not None else ": memory"))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    axes[-1].set_xlabel("step")
    return fig


def moves_figure(runs: list[Any]) -> Figure:
    """Swap rate per link (bytes moved / step time), segments fetched vs plan (when any were
    fetched or planned), and PCIe utilisation where NVML knew the link's peak."""
    panels = ["rates"]
    # a plan that streams nothing (everything resident) has no fetches to draw: a flat zero
    if any(series(r.steps, k)[1].max(initial=0) > 0 for r in runs
           for k in ("segments_fetched", "segments_fetched_planned")):
        panels.append("fetches")
    if has(runs, "pcie_h2d_util"):
        panels.append("pcie")
    fig = Figure(figsize=(WIDTH_IN, 3.2 * len(panels) + 0.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    links = [link for link in Link
             if any(series(r.steps, f"{link}_bytes_per_s")[1].max(initial=0) > 0 for r in runs)]
    if not links:
        _empty(ax, "no transfers: the reference trainer keeps the model on the device")
    all_rates = np.concatenate([series(r.steps, f"{link}_bytes_per_s")[1]
                                for r in runs for link in links] or [np.zeros(1)])
    top = robust_top(all_rates) or float(all_rates.max())
    unit, scale = rate_unit(top)
    for i, run in enumerate(runs):
        tag = f" ({run.name})" if len(runs) > 1 else ""
        for link in links:
            x, y = series(run.steps, f"{link}_bytes_per_s")
            _line(ax, x, y / scale, f"{link}/{run.name}", color=LINK_COLOR.get(link),
                  ls=RUN_STYLE[i], lw=1.4, label=LINK_LABEL.get(link, link) + tag)
    if links:
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0, top=1.3 * top / scale)  # headroom for the legend
        ax.legend(loc="upper right", fontsize="small", ncols=len(links) * len(runs))
        ax.grid(alpha=0.3)
    ax.set_title(_title(runs, "Bytes moved per second of step, per link"))
    for name, ax in zip(panels[1:], axes[1:], strict=True):
        for i, run in enumerate(runs):
            tag = f" ({run.name})" if len(runs) > 1 else ""
            if name == "fetches":
                x, y = series(run.steps, "segments_fetched_planned")
                _line(ax, x, y, f"segments_fetched_planned/{run.name}", color="0.55",
                      ls=RUN_STYLE[i], lw=4, alpha=0.5, label=f"planned{tag}")
                x, y = series(run.steps, "segments_fetched")
                _line(ax, x, y, f"segments_fetched/{run.name}", color=RUN_COLOR[i],
                      ls="none", marker=RUN_MARKER[i], ms=4, label=f"fetched{tag}")
                ax.set_ylabel("segments / step")
                ax.set_title("Segments fetched to the device per step (swaps)")
            else:
                for link in (Link.H2D, Link.D2H):
                    x, y = series(run.steps, f"pcie_{link}_util")
                    _line(ax, x, 100 * y, f"pcie_{link}_util/{run.name}",
                          color=LINK_COLOR[link], ls=RUN_STYLE[i],
                          label=f"{LINK_LABEL[link]}{tag}")
                ax.set_ylabel("% of link peak")
                ax.set_title("PCIe utilisation (bytes moved per second / link peak)")
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.3)  # headroom for the legend
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small", ncols=2 * len(runs))
    axes[-1].set_xlabel("step")
    return fig


def fp8_figure(runs: list[Any]) -> Figure | None:
    """Heatmap of the fp8 underflow fraction per layer (rows) and step (columns), per run."""
    used = [r for r in runs if any(s.get("fp8_underflow_by_layer") for s in r.steps)]
    if not used:
        return None
    layer_counts = [len({k for s in r.steps for k in s.get("fp8_underflow_by_layer") or {}})
                    for r in used]
    fig = Figure(figsize=(WIDTH_IN, max(3.0, 0.22 * max(layer_counts) + 1.5) * len(used)),
                 layout="constrained")
    axes = fig.subplots(len(used), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, used, strict=True):
        recs = [s for s in run.steps if s.get("fp8_underflow_by_layer")]
        layers = list(dict.fromkeys(k for s in recs for k in s["fp8_underflow_by_layer"]))
        grid = np.full((len(layers), len(recs)), math.nan)
        for j, s in enumerate(recs):
            for i, name in enumerate(layers):
                v = s["fp8_underflow_by_layer"].get(name)
                grid[i, j] = math.nan if v is None else 100 * v
        steps = [s["step"] for s in recs]
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
        im.set_gid(f"fp8_underflow/{run.name}")
        ax.set_yticks(range(len(layers)), labels=layers,
                      fontsize="small" if len(layers) < 40 else "x-small")
        ax.set_xlabel("step")
        ax.set_title(f"fp8 underflow per layer: {run.name}")
        fig.colorbar(im, ax=ax, label="% of values flushed to zero")
    return fig


def build_figures(runs: list[Any]) -> dict[str, Figure]:
    """name -> figure; `fp8_underflow` only when a run computed in fp8."""
    figs = {
        "loss": loss_figure(runs),
        "step_time": step_time_figure(runs),
        "memory": memory_figure(runs),
        "moves": moves_figure(runs),
    }
    fp8 = fp8_figure(runs)
    if fp8 is not None:
        figs["fp8_underflow"] = fp8
    return figs

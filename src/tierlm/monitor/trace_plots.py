"""The report's drawings of RUN_DIR/trace.json (`--monitor.trace_step`): the step's lanes,
measured and predicted, and the placement map (segment x tier, bytes per class).

Each lane row is a `broken_barh` collection whose gid is `trace/<process>/<row>`, and each
placement bar container is labelled `<tier>/<class>`, so tests can read the drawing back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from tierlm.memory.tiers import TensorClass, Tier
from tierlm.monitor.plots import WIDTH_IN, byte_unit
from tierlm.trace import LANES, MEASURED_PID, PREDICTED_PID

LANE_COLOR = {"step": "tab:olive", "compute": "tab:blue", "wait": "tab:gray", "H2D": "tab:purple",
              "D2H": "tab:pink", "disk read": "tab:green", "disk write": "tab:red",
              "cpu update": "tab:orange", "device update": "tab:cyan"}
CLASS_COLOR = {TensorClass.COMPUTE: "tab:blue", TensorClass.MASTER: "tab:orange",
               TensorClass.OPTIM: "tab:green", TensorClass.GRAD: "tab:red"}


def trace_rows(trace: dict[str, Any], pid: int) -> dict[str, list[tuple[float, float, str]]]:
    """Row name -> [(start ms, duration ms, lane)] of one process, rows in drawing order."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] == pid}
    rows: dict[str, list[tuple[float, float, str]]] = {}
    for tid in sorted(names):
        rows[names[tid]] = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["pid"] == pid:
            lane = e.get("args", {}).get("lane", names[e["tid"]])
            rows[names[e["tid"]]].append((e["ts"] / 1e3, e["dur"] / 1e3, lane))
    return {k: v for k, v in rows.items() if v}


def _lane_of(row: str) -> str:
    head, _, tail = row.rpartition(" ")
    return head if tail.isdigit() and head else row


def trace_figure(trace: dict[str, Any], title: str) -> Figure:
    procs = [(pid, name) for pid, name in ((MEASURED_PID, "measured"),
                                           (PREDICTED_PID, "predicted"))
             if trace_rows(trace, pid)]
    heights = [max(1, len(trace_rows(trace, pid))) for pid, _ in procs] or [1]
    fig = Figure(figsize=(WIDTH_IN, 1.2 + 0.32 * sum(heights) + 0.6 * len(heights)),
                 layout="constrained")
    axes = fig.subplots(len(heights), 1, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (pid, name) in zip(axes, procs, strict=False):
        rows = trace_rows(trace, pid)
        order = sorted(rows, key=lambda r: (LANES.index(_lane_of(r)) if _lane_of(r) in LANES
                                            else len(LANES), r))
        span = max((s + d for evs in rows.values() for s, d, _ in evs), default=0.0)
        for i, row in enumerate(order):
            evs = rows[row]
            color = LANE_COLOR.get(evs[0][2], "tab:brown")
            # a zero-length event still shows as a hairline
            bars = [(s, max(d, span * 1e-4)) for s, d, _ in evs]
            coll = ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=color, edgecolor="none")
            coll.set_gid(f"trace/{name}/{row}")
        ax.set_yticks(range(len(order)), labels=order, fontsize="small")
        ax.set_ylim(len(order) - 0.5, -0.5)
        ax.set_xlim(0, span * 1.01 or 1.0)
        ax.set_xlabel("ms since the step started")
        ax.set_title(f"{name}: {span:.1f} ms", fontsize="medium")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    return fig


def placement_figure(placement: list[dict[str, Any]], title: str) -> Figure:
    segs = [p["segment"] for p in placement]
    tiers = [t for t in Tier if any(str(t) in p["bytes"] for p in placement)] or list(Tier)
    top = max((sum(p["bytes"].get(str(t), {}).values()) for p in placement for t in tiers),
              default=1)
    unit, scale = byte_unit(top)
    fig = Figure(figsize=(WIDTH_IN, 1.5 + 0.25 * len(segs)), layout="constrained")
    axes = fig.subplots(1, len(tiers), sharey=True, squeeze=False)[0]
    y = np.arange(len(segs))
    for ax, tier in zip(axes, tiers, strict=True):
        left = np.zeros(len(segs))
        for cls in CLASS_COLOR:
            vals = np.array([p["bytes"].get(str(tier), {}).get(str(cls), 0) for p in placement],
                            dtype=float) / scale
            if not vals.any():
                continue
            ax.barh(y, vals, left=left, color=CLASS_COLOR[cls], label=f"{tier}/{cls}")
            left += vals
        ax.set_title(str(tier))
        ax.set_xlabel(unit)
        ax.set_xlim(0, top / scale * 1.05)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels=[f"{s}{' (resident)' if p['resident'] else ''}"
                                  for s, p in zip(segs, placement, strict=True)],
                       fontsize="small" if len(segs) < 40 else "x-small")
    axes[0].set_ylim(len(segs) - 0.5, -0.5)
    seen: dict[str, Any] = {}  # legend: one entry per class drawn
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab.split("/", 1)[1], h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center",
                   ncols=len(seen))
    fig.suptitle(title)
    return fig

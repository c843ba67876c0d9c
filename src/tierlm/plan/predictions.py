"""The plan's predictions as a run reports them: predicted rates, the start lines, the record
logged beside the measured step, and the simulated step's line."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tierlm.memory.tiers import Tier
from tierlm.plan.describe import _short
from tierlm.plan.result import Plan


def predicted_rates(p: Plan | None, tokens_per_step: int, trained_share: float
                    ) -> dict[str, float | None]:
    """The plan's step time and tokens/s for the whole run (`tokens_per_step`: all ranks),
    both all tokens and trained ones (tokens with a loss: `trained_share` of them, measured on
    the training data; the planner times every token, masked or not). None without a plan (the
    reference trainer)."""
    if p is None:
        return dict.fromkeys(("predicted_step_time_s", "predicted_tokens_per_s",
                              "predicted_trained_tokens_per_s"))
    tokens_per_s = tokens_per_step / p.step_s
    return {"predicted_step_time_s": p.step_s, "predicted_tokens_per_s": tokens_per_s,
            "predicted_trained_tokens_per_s": tokens_per_s * trained_share}


def plan_start_lines(p: Plan, rates: dict[str, float | None], trained_share: float
                     ) -> list[str]:
    """What a run on the tiered runtime says of its plan before the first step: where each
    segment's state lives, which compute weights stay on the device, and the predicted step
    time and tokens/s (all and trained)."""
    counts = p.tier_counts()
    resident = p.resident_names()
    n = len(p.placements)
    return [
        f"plan: state of {n} segments: {counts['device']} on device, {counts['host']} in host "
        f"RAM, {counts['disk']} on disk; compute weights resident on the device: "
        f"{_short(resident)}; streamed: {n - len(resident)}; micro-batch order {p.order}",
        f"plan: predicted step {p.step_s:.3f} s (bottleneck: {p.bottleneck}), "
        f"{rates['predicted_tokens_per_s']:,.0f} tok/s, trained "
        f"{rates['predicted_trained_tokens_per_s']:,.0f} tok/s ({trained_share:.1%} of the "
        "tokens have a loss)",
    ]


def prediction_record(p: Plan, engine: Any | None, step: int,
                      measured: dict[str, float] | None = None,
                      rates: dict[str, float | None] | None = None) -> dict[str, Any]:
    """Predicted vs measured peak bytes per tier and of pinned host memory (measured: the
    engine's ledger; on CUDA also torch.cuda.max_memory_allocated), and with `rates`
    (`predicted_rates`) and `measured` (the run's median `step_time_s`, `tokens_per_s`,
    `trained_tokens_per_s`) the step time and tokens/s beside them."""
    rec: dict[str, Any] = {"step": step, "predicted_device_total_bytes": p.device_total_bytes,
                           "predicted_device_peak_bytes": p.device_peak_bytes,
                           "predicted_host_peak_bytes": p.host_peak_bytes,
                           "predicted_disk_bytes": p.disk_bytes,
                           "predicted_pinned_peak_bytes": p.pinned_peak_bytes}
    if engine is not None:
        led = engine.ledger
        rec.update(measured_device_peak_bytes=led.peak_tier_bytes[Tier.DEVICE],
                   measured_host_peak_bytes=led.peak_tier_bytes[Tier.HOST],
                   measured_disk_bytes=led.tier_bytes(Tier.DISK),
                   measured_pinned_peak_bytes=led.pinned_peak_bytes)
    if torch.cuda.is_available():
        rec["measured_cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    rec.update(rates or {})
    rec.update({f"measured_{k}": v for k, v in (measured or {}).items()})
    return rec


def prediction_lines(rec: dict[str, Any], *, simulated: bool = False) -> list[str]:
    """The run's closing lines of `prediction_record`: predicted vs measured peak per tier,
    step time and tokens/s (all and trained). `simulated`: a run on a simulated GPU
    (`--device sim:PROFILE`), whose step is predicted for that GPU while its measured times
    are this CPU's: those are shown without a ratio (`simulated_step_line` compares the
    simulated step with the plan's)."""
    lines = []
    for tier, key in (("device", "peak_bytes"), ("host", "peak_bytes"), ("disk", "bytes"),
                      ("pinned", "peak_bytes")):  # pinned: host bytes locked for PCIe copies
        measured = rec.get(f"measured_{tier}_{key}")
        predicted = rec.get(f"predicted_{tier}_{key}")
        if measured is None or predicted is None:
            continue
        # a tier the plan leaves empty: a ratio to nothing would read as a misprediction
        ratio = (f"{measured / predicted:.2f}x" if predicted
                 else "as planned" if not measured else "none planned")
        label = f"peak {tier} bytes" if key == "peak_bytes" else f"{tier} tier bytes"
        lines.append(f"{label}: predicted {predicted / 2**20:.1f} MiB, measured "
                     f"{measured / 2**20:.1f} MiB ({ratio})")
    for key, label, fmt in (("step_time_s", "step time (median)", "{:.3f} s"),
                            ("tokens_per_s", "tokens/s (median)", "{:,.0f}"),
                            ("trained_tokens_per_s", "trained tokens/s (median)", "{:,.0f}")):
        measured, predicted = rec.get(f"measured_{key}"), rec.get(f"predicted_{key}")
        if measured is None:
            continue
        if predicted is None:  # the reference trainer: no plan to compare with
            lines.append(f"{label}: measured {fmt.format(measured)}")
            continue
        if simulated:
            lines.append(f"{label}: predicted {fmt.format(predicted)} on the simulated GPU, "
                         f"measured {fmt.format(measured)} on this CPU (not comparable; the "
                         "simulated step below is)")
            continue
        ratio = f" ({measured / predicted:.2f}x)" if predicted else ""
        lines.append(f"{label}: predicted {fmt.format(predicted)}, measured "
                     f"{fmt.format(measured)}{ratio}")
    return lines


SIM_KEYS = ("sim_step_s", "sim_compute_s", "sim_h2d_s", "sim_d2h_s", "sim_disk_s",
            "sim_cpu_update_s", "sim_cpu_s", "sim_transfer_wait_s")


def simulated_step_line(device: str, steps: list[dict[str, float]], p: Plan | None) -> str:
    """`--device sim:PROFILE`'s end line: the median simulated step, each lane's busy time in
    it, and the plan's step beside it."""
    med = {k: statistics.median(s[k] for s in steps) for k in SIM_KEYS}
    parts = ", ".join(f"{label} {med[k]:.4g} s" for label, k in (
        ("compute", "sim_compute_s"), ("H2D", "sim_h2d_s"), ("D2H", "sim_d2h_s"),
        ("disk", "sim_disk_s"), ("CPU update", "sim_cpu_update_s"),
        ("CPU adds", "sim_cpu_s"), ("compute waiting for copies", "sim_transfer_wait_s")))
    planned = "" if p is None else f"; the plan predicted {p.step_s:.4g} s"
    if p is not None and "simulated_step" in p.times_s:  # its replay on the same simulator
        planned += f" (its replay simulated {p.times_s['simulated_step']:.4g} s)"
    return (f"simulated step on {device} (median of {len(steps)}): {med['sim_step_s']:.4g} s "
            f"({med['sim_step_s'] / max(med['sim_compute_s'], 1e-30):.2f}x its compute); "
            f"lanes busy: {parts}{planned}")

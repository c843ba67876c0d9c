"""What would fit when nothing does: the least budget of each tier (device, host, disk) at which
the search finds a plan, said as the flag to change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tierlm.config import parse_bytes
from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import (
    gib,
)
from tierlm.plan.result import GPU_RESERVE_BYTES, SAFETY_MARGIN, Plan
from tierlm.runtime.shapes import ModelShape, TrainShape

BUDGET_FLAGS = {"device": "--device-budget", "host": "--host-budget", "disk": "--disk-budget"}


BUDGET_WHAT = {"device": "device memory", "host": "host RAM",
               "disk": "free disk at --offload-dir"}


ADVICE_DOUBLINGS = 4  # past 16x the plan's own need, no budget of that tier is advised


def _size_text(nbytes: int) -> str:
    """`nbytes` rounded up to two decimals of the unit `gib` prints it in, as a flag's value."""
    unit, scale = _size_unit(nbytes)
    return f"{-(-nbytes * 100 // scale) / 100:.2f}{unit}"


def _size_unit(nbytes: float) -> tuple[str, int]:
    """The unit `gib` prints `nbytes` in."""
    return next(((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20)) if nbytes >= k),
                ("KiB", 2**10))


def _least_budget(fits_at: Callable[[int], bool], lo: int, need: int) -> str | None:
    """The least budget above `lo` (where it does not fit) at which `fits_at` holds, to three
    significant digits of the unit `gib` prints `need` in ("1.03GiB", "569MiB"), as a flag's
    value, checked at the bytes `tierlm.config.parse_bytes` reads back from it; None where
    none up to 2**ADVICE_DOUBLINGS x `need` fits. Starts at `need` (the closest plan's own
    need, where the answer usually is), gallops away from it, then bisects."""
    unit, scale = _size_unit(need)

    def stride(k: int) -> int:  # hundredths of the unit a printed digit stands for here
        return 100 if k >= 100 * 100 else 10 if k >= 10 * 100 else 1

    def text(k: int) -> str:  # k hundredths of the unit
        return f"{k / 100:.{ {100: 0, 10: 1, 1: 2}[stride(k)] }f}{unit}"

    tried: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            tried[k] = fits_at(parse_bytes(text(k)))
        return tried[k]

    def up(k: int) -> int:  # k rounded up to a printed value
        return -(-k // stride(k)) * stride(k)

    k_lo = lo * 100 // scale  # its printed value is at most `lo`: it does not fit
    k_hi = up(max(k_lo + 1, -(-need * 100 // scale)))
    if ok(k_hi):  # gallop down to a value that does not fit
        step = stride(k_hi)
        while k_hi - step > k_lo and ok(k_hi - step):
            k_hi -= step
            step *= 2
        k_lo = max(k_lo, k_hi - step)
    else:  # gallop up
        for _ in range(ADVICE_DOUBLINGS):
            k_lo, k_hi = k_hi, up(2 * k_hi)
            if ok(k_hi):
                break
        else:
            return None
    while k_hi - k_lo > stride(k_hi):
        mid = up((k_lo + k_hi) // 2)
        if mid >= k_hi:
            break
        if ok(mid):
            k_hi = mid
        else:
            k_lo = mid
    return text(k_hi)


def _what_would_fit(search: Callable[..., Plan], shape: ModelShape, train: TrainShape,
                    hw: HardwareProfile, p: Plan, device_budget: int | None,
                    host_budget: int | None) -> list[str]:
    """What would make `p`'s search find a plan: for each budget it overshoots, the least
    value of that budget alone at which `search` (the planner's own) finds one, checked at the
    value printed; all of them together where none alone does; and on the device, the step
    and precision changes that `search` confirms fit within the budgets as they are."""
    sizes = {"device": hw.gpu_memory_bytes - (0 if hw.device_is_cpu else GPU_RESERVE_BYTES),
             "host": hw.host_memory_bytes}
    raw = {"device": device_budget if device_budget is not None else sizes["device"],
           "host": host_budget if host_budget is not None else sizes["host"],
           "disk": hw.disk_budget_bytes}

    needs = {"device": p.device_total_bytes, "host": p.host_peak_bytes, "disk": p.disk_bytes}
    over = [t for t in raw if needs[t] > p.budgets[t]]

    def fits(budgets: dict[str, int], step: TrainShape = train) -> bool:
        return search(step, hw.with_overrides(disk_budget_bytes=budgets["disk"]),
                      budgets["device"], budgets["host"]).fits

    def need(t: str) -> int:  # the plan's own need, grossed up by the margin
        return int(needs[t] / (1 - SAFETY_MARGIN))

    hints = []
    for t in over:
        least = _least_budget(lambda v, t=t: fits({**raw, t: v}), raw[t], need(t))
        if least is not None:
            beyond = (f", more than {hw.name}'s {gib(sizes[t])}"
                      if parse_bytes(least) > sizes.get(t, 1 << 62) else "")
            hints.append(f"at least {least} of {BUDGET_WHAT[t]}{beyond} ({BUDGET_FLAGS[t]} "
                         f"{least})")
    if not hints and len(over) > 1:  # raised together, each to its share of its own need
        def raised(share: int) -> dict[str, int]:  # `share` in 1/1024ths of each need
            return {**raw, **{t: max(raw[t], need(t) * share // 1024) for t in over}}

        least = _least_budget(lambda v: fits(raised(v)), 1023, 1024)
        if least is not None:
            share = parse_bytes(least)
            values = {t: _size_text(raised(share)[t]) for t in over}
            if fits({**raw, **{t: parse_bytes(v) for t, v in values.items()}}):
                hints.append(" ".join(f"{BUDGET_FLAGS[t]} {v}" for t, v in values.items()))
    if "device" in over:
        steps = []
        if train.batch_size > 1:
            steps.append((f"a smaller micro-batch (--batch-size {train.batch_size // 2} "
                          f"--grad-accum-steps {train.micro_batches * 2})",
                          dataclasses.replace(train, batch_size=train.batch_size // 2,
                                              micro_batches=train.micro_batches * 2)))
        if train.precision == "fp32" and shape.base_bytes is None:
            steps.append(("--precision bf16 (smaller activations)",
                          dataclasses.replace(train, precision="bf16")))
        if p.workspace_bytes > p.budgets["device"] // 4:  # a long sequence: share it over ranks
            cp = 2 * train.context_parallel
            row = train.seq_len * train.context_parallel
            steps.append((f"--context-parallel {cp} (each rank holds {row // cp} tokens of "
                          "every row) or a shorter --seq-len",
                          dataclasses.replace(train, seq_len=row // cp, context_parallel=cp,
                                              nproc=max(train.nproc, cp))))
        hints += [text for text, step in steps if fits(raw, step)]
    return ["would fit with: " + "; or ".join(hints)] if hints else []

"""The live view of a run: a rich panel on a terminal, plain lines everywhere else.

Both views show the same things from the step record: step / total and ETA, loss (its variance
over the last steps and the latest held-out loss), tokens/s (all tokens, and trained ones: those
with a loss; each beside the plan's prediction), the step time split into compute,
transfer wait and update wait, peak bytes per tier, swap rates per link, skipped steps and
alerts. `open_view` picks the terminal view only when the stream is a TTY, so CI logs and files
get one line every `every` steps.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tierlm.memory.tiers import Link, Tier
from tierlm.progress import RichProgress, fmt_duration

_LINK_LABEL = {Link.H2D: "H2D", Link.D2H: "D2H", Link.DISK_READ: "disk read",
               Link.DISK_WRITE: "disk write", Link.NET_SEND: "net send",
               Link.NET_RECV: "net recv"}


def _shown(link: Link, rec: dict[str, Any]) -> bool:
    """PCIe links always; disk links where a disk tier exists; others once they move bytes."""
    if link in (Link.H2D, Link.D2H):
        return True
    if link in (Link.DISK_READ, Link.DISK_WRITE):
        return bool(rec.get(f"{Tier.DISK}_peak_bytes"))
    return bool(rec.get(f"{link}_bytes_per_s"))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bps: float | None) -> str:
    if bps is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} B/s"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _rate(rec: dict[str, Any], key: str) -> str:
    """A tokens/s field, beside the plan's prediction where the run has one."""
    text = _num(rec.get(key), ",.0f") + " tok/s"
    if rec.get(f"predicted_{key}") is not None:
        text += f" (plan {rec[f'predicted_{key}']:,.0f})"
    return text


def summary_parts(rec: dict[str, Any], eval_rec: dict[str, Any] | None,
                  alert_counts: dict[str, int]) -> dict[str, str]:
    """The view's rows as text: loss, time, memory, moves, health."""
    loss = f"{_num(rec['loss'], '.4f')}  var {_num(rec.get('loss_var'), '.3g')}"
    if eval_rec is not None:
        loss += f"  eval {eval_rec['eval_loss']:.4f} (step {eval_rec['step']})"
    loss += f"  {_rate(rec, 'tokens_per_s')}, trained {_rate(rec, 'trained_tokens_per_s')}"
    parts = rec["compute_s"] + rec["transfer_wait_s"] + rec["update_wait_s"]
    time_row = (
        f"step {rec['step_time_s']:.3f}s = compute {rec['compute_s']:.3f}"
        f" + transfer wait {rec['transfer_wait_s']:.3f} + update wait {rec['update_wait_s']:.3f}"
        f" + other {max(0.0, rec['step_time_s'] - parts):.3f}"  # data, unawaited copies, sync
    )
    mem = [f"{t} {fmt_bytes(rec.get(f'{t}_peak_bytes'))}" for t in Tier
           if rec.get(f"{t}_peak_bytes")]
    if rec.get("cuda_max_allocated_bytes") is not None:
        mem.append(f"CUDA allocated {fmt_bytes(rec['cuda_max_allocated_bytes'])}")
    mem.append(f"process RSS {fmt_bytes(rec.get('rss_peak_bytes'))}")
    if rec.get(f"{Link.H2D}_bytes") is None:
        moves = "none (reference trainer: the model stays on the device)"
    else:
        moves = "  ".join(
            f"{_LINK_LABEL.get(link, link)} {fmt_rate(rec.get(f'{link}_bytes_per_s'))}"
            for link in Link if _shown(link, rec)
        )
        if rec.get("segments_fetched") is not None:
            moves += (f"  fetched {rec['segments_fetched']}/step"
                      f" (plan {rec['segments_fetched_planned']})")
    total = sum(alert_counts.values())
    health = f"skipped {rec.get('skipped_steps', 0)}  alerts {total}"
    if total:
        health += " (" + ", ".join(f"{k} {v}" for k, v in alert_counts.items() if v) + ")"
    if rec.get("gpu_sm_clock_mhz") is not None:
        health += (f"  GPU {rec['gpu_sm_clock_mhz']} MHz {_num(rec.get('gpu_temp_c'), '')} C"
                   f" {_num(rec.get('gpu_power_w'), '.0f')} W")
    return {"loss": loss, "time": time_row, "peak": "  ".join(mem), "moves": moves,
            "health": health}


class LineView:
    """One line every `every` steps (and the first and last), for logs and CI."""

    def __init__(self, total: int, start: int, stream: TextIO, every: int) -> None:
        self.total, self.start, self.stream, self.every = total, start, stream, every
        self.t0 = time.perf_counter()

    def log(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def update(self, rec: dict[str, Any], eval_rec: dict[str, Any] | None,
               alert_counts: dict[str, int]) -> None:
        step = rec["step"]
        if not (step % self.every == 0 or step == self.total or step == self.start + 1):
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        p = summary_parts(rec, eval_rec, alert_counts)
        self.log(f"step {step}/{self.total}  loss {p['loss']} | {p['time']} | peak {p['peak']} | "
                 f"moves {p['moves']} | {p['health']} | eta {fmt_duration(eta)}")

    def show_eval(self, eval_rec: dict[str, Any]) -> None:
        pass  # the evaluation's own log line says it

    def close(self) -> None:
        pass


class RichView:
    """A progress bar and a table of the latest step, redrawn in place."""

    def __init__(self, total: int, start: int, stream: TextIO, phases: Any = None) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.table import Table

        self._table_cls = Table
        self._group_cls = Group
        self.console = Console(file=stream)
        self.total = total
        self.bar = RichProgress.new_bar(self.console)
        self.task = self.bar.add_task("train", total=total, completed=start,
                                      amount=f"{start}/{total} steps")
        self.table = self._rows({"loss": "waiting for the first step"})
        self._last: tuple[dict[str, Any], dict[str, int]] | None = None
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         get_renderable=self._render)
        self.live.start()
        # evaluation, checkpoints and other phases of the run show as tasks of our bar
        self.phases = phases
        if phases is not None:
            phases.host(self)

    def _rows(self, parts: dict[str, str]):
        table = self._table_cls.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for name, text in parts.items():
            table.add_row(name, text)
        return table

    def _render(self):
        return self._group_cls(self.bar, self.table)

    def log(self, message: str) -> None:
        self.live.console.print(message, markup=False, highlight=False)

    def update(self, rec: dict[str, Any], eval_rec: dict[str, Any] | None,
               alert_counts: dict[str, int]) -> None:
        self.bar.update(self.task, completed=rec["step"],
                        amount=f"{rec['step']}/{self.total} steps")
        self.table = self._rows(summary_parts(rec, eval_rec, alert_counts))
        self._last = (rec, alert_counts)

    def show_eval(self, eval_rec: dict[str, Any]) -> None:
        if self._last is not None:
            rec, counts = self._last
            self.table = self._rows(summary_parts(rec, eval_rec, counts))

    def close(self) -> None:
        if self.phases is not None:
            self.phases.host(None)
        self.live.refresh()
        self.live.stop()


def open_view(total: int, start: int, *, stream: TextIO | None = None, every: int = 10,
              phases: Any = None):
    """`phases`: the run's progress (tierlm.progress); the terminal view draws its
    phases (evaluation, checkpoints) while it is open."""
    stream = stream or sys.stdout
    if stream.isatty():
        return RichView(total, start, stream, phases)
    return LineView(total, start, stream, every)

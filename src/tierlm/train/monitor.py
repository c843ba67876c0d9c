"""Metrics file and progress display.

`MetricsLog` appends one JSON object per line to RUN_DIR/metrics.jsonl and flushes each line, so a
crash loses at most the line being written. `Progress` is a rich progress bar on a terminal and
plain periodic lines otherwise (CI logs, files).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    def __init__(self, path: Path, *, resume_from_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and path.exists():
            self._truncate_after(resume_from_step)
        elif resume_from_step is None and path.exists():
            path.unlink()
        self._f: TextIO = path.open("a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        """Drop records written after the checkpoint we resume from: that work is redone."""
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if rec.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Shows step, loss, tokens/s and ETA. Rich bar on a TTY; plain lines every `every` steps."""

    def __init__(
        self, total_steps: int, start_step: int, *, stream: TextIO | None = None, every: int = 10
    ) -> None:
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.every = every
        self.t0 = time.perf_counter()
        self.start_step = start_step
        self._bar = None
        if self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, info="")
            self._bar.update(self._task, completed=start_step)
            self._bar.start()

    def log(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, file=self.stream, flush=True)

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        info = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s {extra}".rstrip()
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        if step % self.every == 0 or step == self.total or step == self.start_step + 1:
            done = step - self.start_step
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - step)
            self.log(f"step {step}/{self.total}  {info}  eta {_fmt_eta(eta)}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

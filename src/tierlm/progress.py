"""Progress of a run's phases other than its steps: loading weights, evaluation, saving a
checkpoint, exporting, sampling. Each can take minutes on a large model; none may be silent.

One `Progress` per process, chosen once (`open_progress`): on a terminal a rich progress bar
(drawn inside the run's live view while that is open, tierlm.monitor.live), elsewhere plain lines
through the run's log, the way the steps are shown; `NO_PROGRESS` where nothing is shown (ranks
other than 0, library calls). A caller opens a phase with its name, total and unit, advances it
and closes it (or uses it as a context manager), without asking which kind it holds.

Plain lines: one when the phase starts, one at most every `every_s` seconds while it runs (done
of total, elapsed, ETA, and the rate for bytes), one when it ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, TextIO

Unit = Literal["batches", "bytes", "tokens", "segments"]


def fmt_amount(n: float, unit: Unit) -> str:
    if unit != "bytes":
        return f"{n:,.0f}"
    for name, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n:.0f} B"


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def done_of_total(done: float, total: float, unit: Unit) -> str:
    if unit == "bytes":
        return f"{fmt_amount(done, unit)} of {fmt_amount(total, unit)}"
    return f"{fmt_amount(done, unit)}/{fmt_amount(total, unit)} {unit}"


class Phase(Protocol):
    def advance(self, n: float = 1) -> None: ...
    def close(self, *, failed: bool = False) -> None: ...
    def __enter__(self) -> Phase: ...
    def __exit__(self, *exc: object) -> None: ...


class Progress(Protocol):
    def phase(self, name: str, total: float, unit: Unit) -> Phase: ...


class _PhaseBase:
    """Counting and timing shared by the views: `done` never shows past `total` (a total that
    was an estimate grows to what was done)."""

    def __init__(self, name: str, total: float, unit: Unit,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.name, self.total, self.unit = name, max(0.0, float(total)), unit
        self.done = 0.0
        self.clock = clock
        self.t0 = clock()
        self.closed = False

    def __enter__(self) -> _PhaseBase:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)  # an error ends it: not "done"

    def _count(self, n: float) -> None:
        self.done += n
        self.total = max(self.total, self.done)

    def eta_s(self) -> float | None:
        elapsed = self.clock() - self.t0
        if self.done <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def finished_text(self, failed: bool = False) -> str:
        elapsed = self.clock() - self.t0
        amount = fmt_amount(self.done, self.unit)
        text = f"{self.name}: {'stopped after ' if failed else ''}"
        text += f"{amount if self.unit == 'bytes' else f'{amount} {self.unit}'}"
        text += f" in {fmt_duration(elapsed)}"
        if self.unit == "bytes" and elapsed > 0:
            text += f" ({fmt_amount(self.done / elapsed, 'bytes')}/s)"
        return text


class LinePhase(_PhaseBase):
    def __init__(self, name: str, total: float, unit: Unit, write: Callable[[str], None],
                 every_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(name, total, unit, clock)
        self.write, self.every_s = write, every_s
        self.last_line = self.t0
        write(f"{name}: {done_of_total(0, self.total, unit)}")

    def advance(self, n: float = 1) -> None:
        self._count(n)
        now = self.clock()
        if now - self.last_line < self.every_s or self.done >= self.total:
            return
        self.last_line = now
        eta = self.eta_s()
        self.write(f"{self.name}: {done_of_total(self.done, self.total, self.unit)}, "
                   f"{fmt_duration(now - self.t0)} elapsed, eta "
                   f"{'-' if eta is None else fmt_duration(eta)}")

    def close(self, *, failed: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.write(self.finished_text(failed))


class LineProgress:
    """Plain lines through `write` (the run's log): for logs, CI and captured output."""

    def __init__(self, write: Callable[[str], None], *, every_s: float = 5.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.write, self.every_s, self.clock = write, every_s, clock

    def phase(self, name: str, total: float, unit: Unit) -> LinePhase:
        return LinePhase(name, total, unit, self.write, self.every_s, self.clock)

    def host(self, view: Any) -> None:
        pass  # lines need no place on the screen


class RichPhase(_PhaseBase):
    def __init__(self, name: str, total: float, unit: Unit, owner: RichProgress) -> None:
        super().__init__(name, total, unit)
        self.owner = owner
        self.bar = owner.bar_for_phase()
        self.task = self.bar.add_task(name, total=self.total or None,
                                      amount=done_of_total(0, self.total, unit))

    def advance(self, n: float = 1) -> None:
        self._count(n)
        self.bar.update(self.task, completed=self.done, total=self.total or None,
                        amount=done_of_total(self.done, self.total, self.unit))

    def close(self, *, failed: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.bar.remove_task(self.task)
            self.owner.phase_closed(self.finished_text(failed))


class RichProgress:
    """A rich progress bar on a terminal. While the run's live view is open (`host`), phases
    are tasks of its bar, drawn by its Live display (a console holds one at a time); otherwise
    this object shows its own bar for the phase's duration. A finished phase leaves one line."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console

        self.console = Console(file=stream)
        self._bar: Any = None  # our own, started while a phase runs outside the live view
        self.view: Any = None  # the live view hosting our phases (has .bar and .log)

    @staticmethod
    def new_bar(console: Any) -> Any:
        """A bar whose tasks say what they count in their `amount` field (steps, batches,
        bytes): the live view builds its own with this too."""
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        return Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.fields[amount]}"), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=console,
                        transient=True)

    def host(self, view: Any) -> None:
        if view is not None and self._bar is not None:
            # a console shows one Live display: a phase left open (a load that did not read
            # every tensor) gives the screen to the view; its task goes on uncounted
            self._bar.stop()
            self._bar = None
        self.view = view

    def bar_for_phase(self) -> Any:
        if self.view is not None:
            return self.view.bar
        if self._bar is None:
            self._bar = self.new_bar(self.console)
            self._bar.start()
        return self._bar

    def phase_closed(self, line: str) -> None:
        if self.view is not None:
            self.view.log(line)
            return
        if self._bar is not None and not self._bar.tasks:
            self._bar.stop()
            self._bar = None
        self.console.print(line, markup=False, highlight=False)

    def phase(self, name: str, total: float, unit: Unit) -> RichPhase:
        return RichPhase(name, total, unit, self)


class NoPhase:
    def advance(self, n: float = 1) -> None:
        pass

    def close(self, *, failed: bool = False) -> None:
        pass

    def __enter__(self) -> NoPhase:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NO_PHASE = NoPhase()


class NoProgress:
    """Shows nothing: ranks other than 0, and library calls that were given no progress."""

    def phase(self, name: str, total: float, unit: Unit) -> NoPhase:
        return NO_PHASE

    def host(self, view: Any) -> None:
        pass


NO_PROGRESS = NoProgress()


def open_progress(write: Callable[[str], None], *, stream: TextIO | None = None,
                  every_s: float = 5.0) -> LineProgress | RichProgress:
    """A rich bar when `stream` (stdout) is a terminal, else plain lines through `write`."""
    stream = stream or sys.stdout
    if stream.isatty():
        return RichProgress(stream)
    return LineProgress(write, every_s=every_s)

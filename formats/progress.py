"""Progress of a long phase (converting, calibrating, scoring) on standard error, for both commands
that have such phases. On a terminal: a rich bar that stays on screen when the phase ends. Otherwise
(a log file, a pipe, CI): plain lines, one when the phase starts, one every tenth of the work or
30 seconds, whichever comes first, with the rate and the time left, and one when it ends."""

from __future__ import annotations

import os
import sys
import time

from .sizes import fmt

LINE_EVERY_S = 30.0
LINE_EVERY_FRACTION = 0.1


def _amount(n: float, unit: str) -> str:
    return fmt(n) if unit == "bytes" else f"{int(n):,} {unit}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Phase:
    """with Phase("calibration", total, "tokens") as p: p.advance(n) ... ; p.note(text) prints a line."""

    def __init__(self, label: str, total: float, unit: str = "tokens", quiet: bool = False, stream=None,
                 terminal: bool | None = None):
        self.label, self.total, self.unit, self.quiet = label, max(float(total), 0.0), unit, quiet
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.done = 0.0
        self.prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "kimi-stream"
        self._bar = None

    def __enter__(self):
        self.t0 = self._last_t = time.monotonic()
        self._last_done = 0.0
        if self.quiet:
            return self
        if self.terminal:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            amount = [DownloadColumn(), TransferSpeedColumn()] if self.unit == "bytes" else \
                [MofNCompleteColumn(), TextColumn(self.unit)]
            self._bar = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(), *amount, TimeRemainingColumn(),
                                 TextColumn("{task.fields[what]}"), console=Console(file=self.stream))
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total or None, what="")
        else:
            self._line(f"started, {_amount(self.total, self.unit)}")
        return self

    def advance(self, n: float, what: str = "") -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=n, what=what[-48:])
            return
        now = time.monotonic()
        step = self.total * LINE_EVERY_FRACTION
        if self.done < self.total and (now - self._last_t >= LINE_EVERY_S
                                       or (step and self.done - self._last_done >= step)):
            self._last_t, self._last_done = now, self.done
            self._line(self._status(now))

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            self.stream.write(f"{self.prog}: {text}\n")
            self.stream.flush()

    def _status(self, now: float) -> str:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        pct = f" ({self.done / self.total:.0%})" if self.total else ""
        left = f", {_duration((self.total - self.done) / rate)} left" if rate > 0 and self.total > self.done else ""
        done = _amount(self.done, self.unit) if self.unit == "bytes" else f"{int(self.done):,}"
        return f"{done} of {_amount(self.total, self.unit)}{pct}, {_amount(rate, self.unit)}/s{left}"

    def _line(self, text: str) -> None:
        self.stream.write(f"{self.prog}: {self.label}: {text}\n")
        self.stream.flush()

    def __exit__(self, kind, value, tb):
        if self.quiet:
            return False
        if self._bar is not None:
            self._bar.__exit__(kind, value, tb)
        elif kind is None and self.done < self.total:         # ended short (failures reported apart)
            self._line(f"stopped at {self._status(time.monotonic()).split(',')[0]}")
        elif kind is None:
            now = time.monotonic()
            self._line(f"done, {_amount(self.done, self.unit)} in {_duration(now - self.t0)} "
                       f"({_amount(self.done / max(now - self.t0, 1e-9), self.unit)}/s)")
        return False

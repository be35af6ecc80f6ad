"""What a long phase shows while it runs, on standard error.

A run's ``guard.Progress`` forwards its phases to a ``PhaseDisplay`` when the command line gives it one
(none with ``--quiet``; a library caller of ``run`` gets one unless it passes its own ``Progress``):

* on a terminal (``isatty()``): one line per phase, redrawn in place at most every ``interval`` seconds,
  with a bar, the steps done (layers, batches, forwards) and an estimate of the time left, from the rate
  so far (before the first step, from the estimate the phase was started with); when the phase ends the
  line is finished with its seconds, so one line per phase stays on the screen;
* otherwise (a file, a pipe, a CI log): one line when a phase starts (with its size and estimate) and
  one when it ends, with its seconds; nothing in between.

Lines of their own (``line``: one per finished ``--workers``/``--ray`` unit, docs/scale-out.md) go to the
same stream, a terminal's or a file's.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

__all__ = ["PhaseDisplay", "format_seconds", "before_message"]

_BAR = 24
_active: "PhaseDisplay | None" = None  # the display whose phase is running (one per process: the command's)


def before_message() -> None:
    """A line is about to be printed on stderr (a warning, an error): a progress line drawn in place there is
    wiped first, so the message starts its own line; the next step draws the progress line again."""
    if _active is not None and _active.phase is not None and _active.tty:
        _active._write("\r\x1b[K")
        _active._drawn = float("-inf")


def format_seconds(seconds: float) -> str:
    """1.2 s, 42 s, 3 min 05 s, 1 h 45 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m} min {s:02d} s"
    h, m = divmod(int(round(seconds)) // 60, 60)
    return f"{h} h {m:02d} min"


class PhaseDisplay:
    """Shows the phases of one command on `stream` (default: sys.stderr, looked up at each write)."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 interval: float = 0.2) -> None:
        self._stream, self.clock, self.interval = stream, clock, interval
        self.phase: str | None = None
        self.total, self.done, self.unit = 0, 0, ""
        self.estimate: float | None = None
        self.start = self._drawn = 0.0

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def tty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):  # a closed or minimal stream
            return False

    def begin(self, phase: str, total: int = 0, unit: str = "", estimate: float | None = None) -> None:
        if self.phase is not None:
            self.end()
        global _active
        _active = self
        self.phase, self.total, self.done, self.unit, self.estimate = phase, max(int(total), 0), 0, unit, estimate
        self.start = self._drawn = self.clock()
        if self.tty:
            self._draw()
        else:
            size = f"{self.total} {unit[:-1] if self.total == 1 and unit.endswith('s') else unit}" if self.total else ""
            est = f"estimated {format_seconds(estimate)}" if estimate is not None else ""
            detail = ", ".join(x for x in (size, est) if x)
            self._write(f"{phase} ..." + (f" ({detail})" if detail else "") + "\n")

    def advance(self, n: int = 1) -> None:
        if self.phase is None:
            return
        self.done = min(self.done + n, self.total) if self.total else self.done + n
        now = self.clock()
        if self.tty and (now - self._drawn >= self.interval or self.done == self.total):
            self._drawn = now
            self._draw()

    def line(self, text: str) -> None:
        """A line of its own among the phases (a finished --workers unit): on a terminal the phase's line is
        wiped first and drawn again at the next step."""
        if self.tty and self.phase is not None:
            self._write("\r\x1b[K" + text + "\n")
            self._drawn = float("-inf")
        else:
            self._write(text + "\n")

    def end(self, status: str = "done") -> None:
        if self.phase is None:
            return
        elapsed = self.clock() - self.start
        line = f"{self.phase}: {status} in {format_seconds(elapsed)}"
        self._write(("\r\x1b[K" + line if self.tty else line) + "\n")
        self.phase = None

    def remaining(self) -> float | None:
        """Seconds left: elapsed x (total - done) / done once a step is done, else the estimate less the
        time elapsed (never below 0); None when neither is known."""
        elapsed = self.clock() - self.start
        if self.total and self.done:
            return elapsed * (self.total - self.done) / self.done
        if self.estimate is not None:
            return max(self.estimate - elapsed, 0.0)
        return None

    def _draw(self) -> None:
        parts = [self.phase or ""]
        if self.total:
            filled = _BAR * self.done // self.total
            parts.append(f"[{'#' * filled}{'.' * (_BAR - filled)}] {self.done}/{self.total} {self.unit}".rstrip())
        parts.append(format_seconds(self.clock() - self.start))
        left = self.remaining()
        if left is not None:
            parts.append(f"about {format_seconds(left)} left")
        self._write("\r\x1b[K" + "  ".join(parts))

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr never fails the run
            pass

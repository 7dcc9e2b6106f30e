"""The live table: one row per region, redrawn in place on a terminal.

On a TTY the table is redrawn about four times a second (cursor home, each line
cleared to its end, the rest of the screen cleared), with colours unless
``NO_COLOR`` is set. Otherwise (a pipe, a log file) it is printed as plain text
every few seconds, and events (partition, heal, convergence) as single lines.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TextIO

__all__ = ["Display", "Frame", "Row", "render"]

Severity = Literal["ok", "warn", "bad"]

_COLORS: dict[str, str] = {"ok": "\x1b[32m", "warn": "\x1b[33m", "bad": "\x1b[31;1m", "dim": "\x1b[2m", "bold": "\x1b[1m"}
_RESET = "\x1b[0m"
_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
_PLAIN_EVERY = 5.0  # seconds between tables when not on a terminal
_TTY_EVERY = 0.25


@dataclass(frozen=True)
class Row:
    region: str
    admitted: int
    denied: int
    view: int | None  # the trailing window's global count as this region sees it (None: unknown)
    lag: float | None  # seconds: oldest cell not yet acknowledged by a peer
    state: str
    severity: Severity = "ok"


@dataclass(frozen=True)
class Frame:
    title: str
    elapsed: float
    seconds: float
    limit: int
    true_count: int  # admitted in the trailing window, all regions (exact)
    phase: str
    rows: Sequence[Row]
    events: Sequence[str] = field(default_factory=tuple)


def _paint(text: str, style: str, color: bool) -> str:
    return f"{_COLORS[style]}{text}{_RESET}" if color else text


def render(frame: Frame, color: bool = False) -> list[str]:
    """The table as lines of text."""
    width = max([6, *(len(r.region) for r in frame.rows)])
    over = frame.true_count - frame.limit
    truth = f"{frame.true_count} of limit {frame.limit}"
    if over > 0:
        truth += " " + _paint(f"({over} over)", "bad", color)
    lines = [
        _paint(frame.title, "bold", color),
        f"t = {frame.elapsed:5.1f} s of {frame.seconds:g} s   true global count (exact, trailing window): {truth}",
        frame.phase,
        "",
        f"{'region':<{width}}  {'admitted':>8}  {'denied':>8}  {'global view':>11}  {'lag':>7}  state",
    ]
    for row in frame.rows:
        view = "?" if row.view is None else str(row.view)
        lag = "?" if row.lag is None else f"{row.lag:.2f} s"
        lines.append(
            f"{row.region:<{width}}  {row.admitted:>8}  {row.denied:>8}  {view:>11}  {lag:>7}  "
            + _paint(row.state, row.severity, color)
        )
    total_admitted = sum(r.admitted for r in frame.rows)
    total_denied = sum(r.denied for r in frame.rows)
    lines.append(f"{'total':<{width}}  {total_admitted:>8}  {total_denied:>8}")
    if frame.events:
        lines.append("")
        lines.extend(_paint(e, "dim", color) for e in frame.events)
    return lines


class Display:
    """Where frames go: redrawn on a terminal, printed now and then elsewhere, nowhere when quiet."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, interactive: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.quiet = quiet
        if interactive is None:
            try:
                interactive = self.stream.isatty()
            except (AttributeError, ValueError):
                interactive = False
        self.interactive = interactive and not quiet
        self.color = self.interactive and not os.environ.get("NO_COLOR")
        self._last_plain: float | None = None
        self._drawn = False

    @property
    def refresh(self) -> float:
        """Seconds between frames."""
        return _TTY_EVERY

    def show(self, frame: Frame) -> None:
        if self.quiet:
            return
        if self.interactive:
            if not self._drawn:
                self._write(_HIDE_CURSOR + "\x1b[2J")
                self._drawn = True
            body = "".join(line + _CLEAR_LINE + "\n" for line in render(frame, self.color))
            self._write(_HOME + body + _CLEAR_BELOW)
        elif self._last_plain is None or frame.elapsed - self._last_plain >= _PLAIN_EVERY - 1e-6:
            self._last_plain = frame.elapsed
            self._write("\n".join(render(_without_events(frame))) + "\n\n")

    def event(self, text: str) -> None:
        """Something happened (plain mode prints it at once; a terminal shows it in the table)."""
        if not self.quiet and not self.interactive:
            self._write(text + "\n")

    def finish(self, frame: Frame | None) -> None:
        """The last frame, left on the screen; the cursor comes back."""
        if self.quiet:
            return
        if self.interactive:
            if frame is not None:
                self.show(frame)
            if self._drawn:
                self._write(_SHOW_CURSOR)
        elif frame is not None and frame.elapsed != self._last_plain:
            self._last_plain = frame.elapsed
            self._write("\n".join(render(_without_events(frame))) + "\n\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not break the demo
            self.quiet = True


def _without_events(frame: Frame) -> Frame:
    return Frame(frame.title, frame.elapsed, frame.seconds, frame.limit, frame.true_count, frame.phase, frame.rows)

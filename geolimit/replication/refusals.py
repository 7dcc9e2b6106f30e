"""Warnings about refused peer messages, at most one per (source, reason) every 10 s.

A peer with the wrong secret (or a clock far off) retries several times a second;
one line per attempt would bury everything else in the log. The refusals are still
counted one by one (``geolimit_gossip_rejected_total``); the log says how many
lines it held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RefusalLog"]

EVERY = 10.0  # seconds between two lines of one source and reason
MAX_SOURCES = 1024  # sources remembered (a flood of addresses cannot grow it)


class RefusalLog:
    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._clock = clock
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last logged, held back since)

    def warn(self, what: str, source: object, exc: BaseException) -> None:
        """Log ``"<what> from <source> refused: <exc>"`` unless the same source and
        error were logged within the last EVERY seconds."""
        key = (str(source)[:80], type(exc).__name__ + str(exc)[:120])
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < EVERY:
            self._last[key] = (last[0], last[1] + 1)
            return
        held = last[1] if last is not None else 0
        if len(self._last) >= MAX_SOURCES:
            self._last.clear()
        self._last[key] = (now, 0)
        more = f" ({held} more like it in the last {EVERY:.0f} s)" if held else ""
        self._log.warning("%s from %s refused: %s%s", what, source, exc, more)

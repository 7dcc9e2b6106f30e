"""Warnings about refused peer messages, at most one per (source, reason) every 10 s.

A peer with the wrong secret (or a clock far off) retries several times a second;
one line per attempt would bury everything else in the log. The refusals are still
counted one by one (``geolimit_gossip_rejected_total``); the log says how many
lines it held back (geolimit/log_every.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from geolimit.log_every import LogEvery

__all__ = ["RefusalLog"]

EVERY = 10.0  # seconds between two lines of one source and reason
MAX_SOURCES = 1024  # sources remembered (a flood of addresses cannot grow it)


class RefusalLog:
    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.lines = LogEvery(log, EVERY, clock=clock, max_keys=MAX_SOURCES)

    def warn(self, what: str, source: object, exc: BaseException) -> None:
        """Log ``"<what> from <source> refused: <exc>"`` unless the same source and
        error were logged within the last EVERY seconds (then a count follows)."""
        key = (str(source)[:80], type(exc).__name__ + str(exc)[:120])
        self.lines.warn(key, f"{what} from {source} refused", str(exc), "like it")

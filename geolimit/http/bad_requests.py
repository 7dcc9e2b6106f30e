"""One log line per 10 s for requests aiohttp cannot parse, instead of a traceback each.

aiohttp answers a request it cannot parse (a bad header line, an unknown HTTP
version, a non-numeric Content-Length ...) with 400 and logs it on
``aiohttp.server`` at ERROR with its traceback: about 11 lines per request. Any
client reaching a listener could fill the log that way (800 malformed requests
wrote 6,800 lines to an agent's log). :func:`install` adds a filter to that
logger that turns those records into one WARNING per ``every`` seconds, counting
what it held back. Other records on the logger (a handler's own exception, a
500) are left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["MalformedRequests", "install"]

_LOGGER = "aiohttp.server"


class MalformedRequests(logging.Filter):
    """Summarizes aiohttp's records of unparsable requests (see the module)."""

    def __init__(self, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self._clock = clock
        self.total = 0  #: every unparsable request seen
        self._held = 0  # since the last line
        self._last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.total += 1
        self._held += 1
        now = self._clock()
        if self._last is not None and now - self._last < self.every:
            return False
        where = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = " ".join(str(exc.message if isinstance(exc.message, str) else exc).split())[:200]
        span = "" if self._last is None else f" in the last {now - self._last:.0f} s"
        record.msg = "%d malformed request(s) answered %d%s (the latest from %s: %s); at most one line per %.0f s"
        record.args = (self._held, exc.code or 400, span, where, reason, self.every)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        self._held = 0
        self._last = now
        return True


def install(every: float = 10.0) -> MalformedRequests:
    """Add the filter to aiohttp's server logger once per process; the installed one."""
    logger = logging.getLogger(_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, MalformedRequests):
            return existing
    summary = MalformedRequests(every)
    logger.addFilter(summary)
    return summary

"""One log line per 10 s for requests aiohttp cannot parse, instead of a traceback each.

aiohttp answers a request it cannot parse (a bad header line, an unknown HTTP
version, a non-numeric Content-Length ...) with 400 and logs it on
``aiohttp.server`` at ERROR with its traceback: about 11 lines per request. Any
client reaching a listener could fill the log that way (800 malformed requests
wrote 6,800 lines to an agent's log). :func:`install` adds a filter to that
logger that drops those records and writes one WARNING instead per ``every``
seconds, counting what it held back (:class:`~geolimit.log_every.LogEvery`, on the
same logger: its count comes once the period is over even if no more come). Other
records on the logger (a handler's own exception, a 500) are left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

from geolimit.log_every import LogEvery

__all__ = ["MalformedRequests", "install"]

_LOGGER = "aiohttp.server"


class MalformedRequests(logging.Filter):
    """Summarizes aiohttp's records of unparsable requests (see the module)."""

    def __init__(self, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self.total = 0  #: every unparsable request seen
        self.lines = LogEvery(logging.getLogger(_LOGGER), every, clock=clock)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # this filter's own lines (no exc_info) too
        self.total += 1
        where = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = " ".join(str(exc.message if isinstance(exc.message, str) else exc).split())[:200]
        code = exc.code or 400
        self.lines.warn(code, f"malformed request answered {code}", f"from {where}: {reason}",
                        "malformed request(s)")
        return False


def install(every: float = 10.0) -> MalformedRequests:
    """Add the filter to aiohttp's server logger once per process; the installed one."""
    logger = logging.getLogger(_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, MalformedRequests):
            return existing
    summary = MalformedRequests(every)
    logger.addFilter(summary)
    return summary

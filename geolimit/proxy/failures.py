"""Upstream failures, for both paths: each one counted, at most one log line per 10 s per upstream and kind.

An upstream that is down while thousands of requests a second go to it, or one
a client can make fail at will, wrote one WARNING line per request. Each failure
still counts in ``geolimit_proxy_upstream_errors_total{upstream,kind}`` (kinds
``connect``, ``timeout``, ``protocol``, ``body_aborted``: bounded, as the
configured upstreams are); the log (geolimit/log_every.py) writes the first
failure of an upstream and kind, then one line per 10 s counting the others::

    upstream http://127.0.0.1:9: cannot connect: [Errno 111] Connection refused
    upstream http://127.0.0.1:9: 1999 more request(s) could not connect in the last 10 s (latest: cannot connect: ...)

A connect timeout is logged as ``connect`` (its line says "cannot connect") and
counted as ``timeout``, as before.
"""

from __future__ import annotations

import logging

from geolimit.log_every import EVERY, LogEvery
from geolimit.proxy.metrics import ProxyMetrics

__all__ = ["UpstreamFailures"]

log = logging.getLogger("geolimit.proxy")

_HELD = {  # what a count line says held back, by the kind it is logged as
    "connect": "request(s) could not connect",
    "timeout": "request(s) timed out waiting for a response",
    "protocol": "request(s) failed",
    "body_aborted": "response(s) broke off mid-body",
}


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class UpstreamFailures:
    """Counts (``metrics``) and logs the upstream failures of one proxy process."""

    def __init__(self, metrics: ProxyMetrics, every: float = EVERY) -> None:
        self.metrics = metrics
        self.lines = LogEvery(log, every)  # its clock is replaceable (tests)

    def unreachable(self, upstream: str, exc: BaseException, timed_out: bool, retrying: bool) -> None:
        """Connecting failed (``timed_out``: within ``connect_timeout``)."""
        self._failed(upstream, "timeout" if timed_out else "connect", "connect",
                     f"cannot connect: {str(exc)[:200] or type(exc).__name__}"
                     f"{'; trying the next upstream' if retrying else ''}")

    def no_response(self, upstream: str, timeout: float, method: str, path: str) -> None:
        self._failed(upstream, "timeout", "timeout", f"no response within {timeout:.3g}s to {method} {path[:200]}")

    def broken(self, upstream: str, method: str, path: str, exc: BaseException) -> None:
        """The exchange failed before the response head arrived whole."""
        self._failed(upstream, "protocol", "protocol", f"{method} {path[:200]} failed: {_exc(exc)}")

    def body_aborted(self, upstream: str, method: str, path: str, exc: BaseException) -> None:
        """The response body broke off once the response had started (the client's connection is aborted)."""
        self._failed(upstream, "body_aborted", "body_aborted", f"response body of {method} {path[:200]} broke off "
                     f"({_exc(exc)}); aborting the client's connection")

    def close(self) -> None:
        """Write the counts still held back (the proxy stops)."""
        self.lines.close()

    def _failed(self, upstream: str, kind: str, logged_as: str, detail: str) -> None:
        self.metrics.upstream_error(upstream, kind)
        self.lines.warn((upstream, logged_as), f"upstream {upstream}", detail, _HELD[logged_as])

"""The proxy's decider logs a rule it cannot decide (a configuration problem) once per 10 s, and
now counts the failures it held back instead of dropping them: the next line, or the one
written when the period ends or the proxy stops, says how many requests failed meanwhile.
A real AsyncLimiter on a real Redis; the log's clock is injected."""

from __future__ import annotations

import logging
import secrets

import pytest

from geolimit import Rule
from geolimit.async_limiter import AsyncLimiter
from geolimit.errors import StorageError
from geolimit.proxy.decider import ProxyDecider


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "geolimit.proxy" and r.levelno == logging.ERROR]


async def test_requests_that_cannot_be_decided_are_counted_in_the_next_line(
    redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = AsyncLimiter.from_url(redis_url, region="east", rules=[Rule("api", 10, 1)],
                                    prefix="t" + secrets.token_hex(4))
    decider = ProxyDecider(limiter)
    now = [100.0]
    decider.lines.clock = lambda: now[0]
    caplog.set_level(logging.ERROR, logger="geolimit.proxy")
    try:
        for _ in range(30):  # each request fails by its on_error (a StorageError), 30 in 3 s
            with pytest.raises(StorageError, match="cannot decide rule"):
                await decider.hit("gone", "client-1")
            now[0] += 0.1
        assert lines(caplog) == ["cannot decide rule(s) gone (configuration problem): unknown rule 'gone'; known rules: api"]
        now[0] += 7.5  # the period is over: the next failure's line counts the 29 held back
        with pytest.raises(StorageError):
            await decider.peek(["api", "missing"], "client-1")
        assert lines(caplog)[1] == ("cannot decide rule(s) api, missing (configuration problem): 30 more request(s) "
                                    "could not be decided in the last 10 s (latest: unknown rule 'missing'; known rules: api)")
        with pytest.raises(StorageError):
            await decider.hit("gone", "client-2")
        assert len(lines(caplog)) == 2, "held back again"
    finally:
        await decider.close()  # writes what is still held back
    assert lines(caplog)[2].startswith("cannot decide rule(s) gone (configuration problem): 1 more request(s) ")

"""Requests aiohttp cannot parse are answered 400 and logged in one line per 10 s, not one traceback each.

Before: 800 malformed requests to an agent wrote 6,800 lines (a traceback of about
11 lines each, at ERROR) to its log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from geolimit.http.bad_requests import MalformedRequests
from tests.server.conftest import StartAgent
from tests.support.malformed import fresh_malformed_filter, send_raw

MALFORMED = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
]


@pytest.fixture
def fresh_filter() -> Iterator[None]:
    with fresh_malformed_filter():
        yield


async def test_malformed_requests_get_400_and_one_log_line(
    start_agent: StartAgent, fresh_filter: None, caplog: pytest.LogCaptureFixture
) -> None:
    agent = await start_agent(run=False)
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    for i in range(60):
        answer = await send_raw(agent.url, MALFORMED[i % len(MALFORMED)])
        assert answer.split(b" ", 2)[1] == b"400", answer[:100]
    ok = await send_raw(agent.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 "), ok[:100]
    records = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    line = records[0]
    assert line.levelname == "WARNING"
    assert line.exc_info is None
    assert line.getMessage().startswith("malformed request answered 400: from 127.0.0.1: ")


def record(exc: BaseException) -> logging.LogRecord:
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                             ("10.0.0.7",), (type(exc), exc, None))


def test_the_next_line_counts_what_was_held_back_and_other_errors_pass(caplog: pytest.LogCaptureFixture) -> None:
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    now = [100.0]
    summary = MalformedRequests(10.0, clock=lambda: now[0])
    logger = logging.getLogger("aiohttp.server")
    logger.addFilter(summary)  # its lines go through it too (and pass)
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    try:
        assert not summary.filter(record(BadHttpMessage("Invalid header token")))  # replaced by a line of its own
        for _ in range(41):
            now[0] += 0.2  # 8.2 s in all: still within the 10 s
            assert not summary.filter(record(BadHttpMessage("x")))
        now[0] += 1.9
        assert not summary.filter(record(LineTooLong("Status line is too long", "8190")))
        crash = record(RuntimeError("a bug in a handler"))
        assert summary.filter(crash)
    finally:
        logger.removeFilter(summary)
    lines = [(r.levelname, r.exc_info, r.getMessage()) for r in caplog.records if r.name == "aiohttp.server"]
    assert lines == [
        ("WARNING", None, "malformed request answered 400: from 10.0.0.7: Invalid header token"),
        ("WARNING", None, "malformed request answered 400: 42 more malformed request(s) in the last 10 s (latest: "
                          "from 10.0.0.7: Got more than 8190 bytes when reading: 'Status line is too long'.)"),
    ]
    assert summary.total == 43
    assert crash.levelno == logging.ERROR
    assert crash.exc_info is not None

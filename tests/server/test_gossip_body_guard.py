"""``POST /v1/gossip`` (and ``/v1/escrow``, through the same guard) reads bodies within a deadline and a byte budget, and a peer that
drops the connection mid-body is counted, not logged with a traceback.

An outsider (no secret needed: the body is read before it is authenticated) held 40
connections that each declared 16 MiB and sent all but one byte: the agent's memory
went from 52 to 699 MB and stayed there, and a connection that sent 1 byte of 1000
was still open after 110 s (now: 408 at the deadline, then at most aiohttp's 10 s
lingering). 2000 requests reset mid-body wrote 34,219 log lines of
tracebacks in 3 s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions, eventually

Factory = Callable[..., EmbeddedRedis]
CAP = 64 * 1024


@pytest.fixture
async def target(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    async with Regions(redis_server_factory, ["a", "b"], [], run_loops=False, max_message_bytes=CAP,
                       timeout=0.5) as rs:
        yield rs


async def _open(rs: Regions, declared: int, sent: int, path: bytes = b"/v1/gossip",
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = rs.urls["b"].removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: b\r\nContent-Type: application/msgpack\r\n"
                 b"Content-Length: %d\r\n\r\n" % declared + b"\0" * sent)
    await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """The status line of the agent's answer (within 10 s). What the client sends after
    it is read and dropped for aiohttp's lingering time (10 s), then the connection closes."""
    return (await asyncio.wait_for(reader.readline(), 10)).strip()


def _rejected(rs: Regions, reason: str) -> float:
    return rs["b"].agent.metrics.rejected.labels(reason)._value.get()  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", [b"/v1/gossip", b"/v1/escrow"])
async def test_a_body_that_never_finishes_gets_408_at_the_deadline_and_the_connection_closes(
    target: Regions, path: bytes,
) -> None:
    reader, writer = await _open(target, 1000, 1, path)
    status = await _answer(reader)  # within 10 s: the deadline is 0.5 s (it used to wait for ever)
    assert status == b"HTTP/1.1 408 Request Timeout"
    if path == b"/v1/gossip":
        assert _rejected(target, "slow_body") == 1
    writer.close()


async def test_bodies_beyond_the_budget_get_503_busy_without_being_read(target: Regions) -> None:
    held = [await _open(target, CAP, CAP - 1) for _ in range(4)]  # the budget: 4 bodies of the cap
    reader, writer = await _open(target, CAP, 0)
    assert await _answer(reader) == b"HTTP/1.1 503 Service Unavailable"
    assert _rejected(target, "busy") == 1
    for r, w in held:  # each of the 4 gets its 408 at the deadline, and the budget is free again
        assert await _answer(r) == b"HTTP/1.1 408 Request Timeout"
        w.close()
    writer.close()
    reader, writer = await _open(target, 10, 10)
    assert (await _answer(reader)).startswith(b"HTTP/1.1 401")  # read whole, then refused: unsigned
    writer.close()


async def test_a_connection_reset_mid_body_is_counted_not_logged_as_a_traceback(
    target: Regions, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(20):
        _, writer = await _open(target, 1000, 1)
        writer.transport.abort()  # RST: the body's read fails
    await eventually(lambda: _rejected(target, "disconnected") == 20, 10, "20 disconnections counted")
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    assert len([r for r in caplog.records if "connection lost mid-body" in r.getMessage()]) == 1  # then held back

"""The rate limit service's HTTP/2 fast path closes a connection left idle for ``rls_idle_timeout``.

A connection that sent its preface and then nothing (or went quiet with no open
stream) was held for ever, keeping its place under ``max_connections``: a flood of
idle connections kept the cap full. A real agent on a real Redis, raw HTTP/2
clients on real sockets (tests/server/h2raw.py); the timeouts are small.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from geolimit.server.agent import Agent
from geolimit.server.rls.h2wire import Error, FrameType
from tests.server.conftest import StartAgent
from tests.server.h2raw import Raw, rls_request
from tests.server.test_rls import EDGE, rls_options
from tests.server.test_rls_h2c_deadline import round_trip, unfinished
from tests.support.regions import eventually

OK_STATUS, DEADLINE_EXCEEDED = 0, 4


def _idle_closed(agent: Agent) -> float:
    return agent.metrics.registry.get_sample_value("geolimit_rls_idle_connections_closed_total") or 0.0


def _open(agent: Agent) -> float:
    value = agent.metrics.registry.get_sample_value("geolimit_http_connections_open", {"listener": "rls_listen"})
    return value or 0.0


async def test_an_idle_connection_gets_goaway_and_gives_its_place_back(
    start_agent: StartAgent, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE), max_connections=2, rls_idle_timeout=0.3)
    caplog.set_level(logging.INFO, "geolimit.agent")
    loop = asyncio.get_running_loop()
    started = loop.time()
    idle = [await Raw.connect(agent.rls_address) for _ in range(2)]  # the preface, then nothing
    for raw in idle:
        assert await raw.goaway() == Error.NO_ERROR  # and the server closed the connection
        await raw.close()
    assert loop.time() - started >= 0.3, "not before the idle timeout"
    assert _idle_closed(agent) == 2
    await eventually(lambda: _open(agent) == 0, what="both places given back")
    fresh = await Raw.connect(agent.rls_address)  # the cap was full: a new client is served
    try:
        assert (await fresh.answer(fresh.call(rls_request()))).status == OK_STATUS
    finally:
        await fresh.close()
    lines = [r.getMessage() for r in caplog.records if "idle HTTP/2 connection" in r.getMessage()]
    assert len(lines) == 1, lines  # the second close is held back (at most one line per 10 s)
    assert "no stream and no frame for 0.3 s" in lines[0]


async def test_requests_and_pings_more_often_than_the_timeout_keep_a_connection_open(
    start_agent: StartAgent, tmp_path: Path,
) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_idle_timeout=0.5)
    raw = await Raw.connect(agent.rls_address)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(8):  # 1.6 s in all, three times the timeout
            await asyncio.sleep(0.2)  # the client's pace, not a wait for the server
            if i % 2:
                await round_trip(raw, i.to_bytes(8, "big"))  # a PING counts as activity
            else:
                assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
        assert loop.time() - started > 1.5
        assert _idle_closed(agent) == 0
        assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS, "still open"
        started = loop.time()
        assert await raw.goaway() == Error.NO_ERROR, "once quiet, closed"
        assert loop.time() - started >= 0.45
    finally:
        await raw.close()


async def test_an_unfinished_stream_is_governed_by_the_request_timeout_not_the_idle_timeout(
    start_agent: StartAgent, tmp_path: Path,
) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_idle_timeout=0.2, rls_request_timeout=1.0)
    raw = await Raw.connect(agent.rls_address)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stuck = unfinished(raw)  # HEADERS and 4 bytes of its message, then nothing for 1 s
        answer = await raw.answer(stuck)  # no GOAWAY before it (Raw.answer raises on one)
        assert loop.time() - started >= 1.0, "the idle timeout did not cut the open stream short"
        assert answer.status == DEADLINE_EXCEEDED
        kind, _, stream, payload = await raw.frame()
        assert (kind, stream, int.from_bytes(payload, "big")) == (FrameType.RST_STREAM, stuck, Error.NO_ERROR)
        assert _idle_closed(agent) == 0
        ended = loop.time()
        assert await raw.goaway() == Error.NO_ERROR, "idle from the stream's end"
        assert loop.time() - ended >= 0.15
        assert _idle_closed(agent) == 1
    finally:
        await raw.close()

"""The rate limit service's HTTP/2 fast path: a request's stream must end within ``rls_request_timeout``.

Each unfinished request used to be held until its connection closed: a client could
keep 256 small unfinished streams per connection for ever, each under the byte
budgets. A real agent on a real Redis, a raw HTTP/2 client on a real socket
(tests/server/h2raw.py); the deadlines are small, or on a clock the test moves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from geolimit.server.agent import Agent
from geolimit.server.rls import h2c, h2conn
from geolimit.server.rls.h2deadline import LOG_EVERY
from geolimit.server.rls.h2wire import END_HEADERS, END_STREAM, Error, FrameType, frame
from tests.server.conftest import StartAgent
from tests.server.h2raw import Raw, grpc_message, request_fields, rls_request
from tests.server.test_rls import EDGE, rls_options

OK_STATUS, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 0, 4, 8


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timeouts(agent: Agent) -> float:
    value = agent.metrics.registry.get_sample_value("geolimit_rls_request_timeouts_total")
    return value or 0.0


def unfinished(raw: Raw, message: bytes = b"") -> int:
    """A stream whose HEADERS and the first bytes of its message are sent, never its end."""
    sid = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())),
             frame(FrameType.DATA, 0, sid, (message or grpc_message(rls_request()))[:4]))
    return sid


async def round_trip(raw: Raw, payload: bytes) -> None:
    """A PING and its ACK: every frame the agent sent before the ACK has been read."""
    raw.send(frame(FrameType.PING, 0, 0, payload))
    while payload not in raw.pings:
        kind, _, stream, _ = await raw.frame()
        if stream and stream not in raw.ended and kind in (FrameType.HEADERS, FrameType.RST_STREAM):
            raise AssertionError(f"stream {stream}: frame {kind} before the PING ACK")


async def test_a_request_that_never_ends_is_reset_and_another_on_its_connection_is_answered(
    start_agent: StartAgent, tmp_path: Path,
) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_request_timeout=0.3)
    raw = await Raw.connect(agent.rls_address)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stuck = unfinished(raw)
        assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS, "answered while the other waits"
        answer = await raw.answer(stuck)  # the reader gives up after h2raw.DEADLINE
        assert loop.time() - started >= 0.3, "not before its deadline"
        assert answer.status == DEADLINE_EXCEEDED
        assert ("grpc-message", "request not complete within 0.3 s") in answer.headers
        kind, _, stream, payload = await raw.frame()  # the client is told to stop sending (RFC 9113 §8.1)
        assert (kind, stream, int.from_bytes(payload, "big")) == (FrameType.RST_STREAM, stuck, Error.NO_ERROR)
        assert timeouts(agent) == 1.0
        assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS, "the connection serves on"
    finally:
        await raw.close()


async def test_the_deadline_runs_on_the_injected_clock_and_is_logged_once_per_10_s(
    start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(h2c, "CLOCK", clock)
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_request_timeout=5.0)
    raw = await Raw.connect(agent.rls_address)
    caplog.set_level(logging.WARNING, "geolimit.agent")
    try:
        first = unfinished(raw)
        assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
        clock.now += 4.9
        await round_trip(raw, b"ping-one")  # the agent looks at its clock after each read...
        await round_trip(raw, b"ping-two")  # ...and anything it sent then came before this ACK
        assert first not in raw.ended, "4.9 s of 5: held"
        clock.now += 0.2
        raw.send(frame(FrameType.PING, 0, 0, b"ping-3.."))
        assert (await raw.answer(first)).status == DEADLINE_EXCEEDED
        assert timeouts(agent) == 1.0

        later = [unfinished(raw), unfinished(raw)]  # due 5 s from now: within 10 s of the line logged
        await round_trip(raw, b"ping-4..")
        clock.now += 5.0
        raw.send(frame(FrameType.PING, 0, 0, b"ping-5.."))
        assert [(await raw.answer(sid)).status for sid in later] == [DEADLINE_EXCEEDED] * 2
        assert timeouts(agent) == 3.0, "each reset counts"
        clock.now += LOG_EVERY
        last = unfinished(raw)
        await round_trip(raw, b"ping-6..")
        clock.now += 5.0
        raw.send(frame(FrameType.PING, 0, 0, b"ping-7.."))
        assert (await raw.answer(last)).status == DEADLINE_EXCEEDED
        lines = [r.getMessage() for r in caplog.records if "not complete within" in r.getMessage()]
        assert len(lines) == 2, lines
        assert lines[0].startswith("rate limit service: reset 1 request(s) from ('127.0.0.1', ")
        assert lines[1].startswith("rate limit service: 3 more request(s) reset in the last 20 s "
                                   "(latest: reset 1 request(s) from ('127.0.0.1', "), lines[1]
        assert lines[1].endswith("not complete within 5 s)"), lines[1]
    finally:
        await raw.close()


async def test_a_reset_request_gives_its_bytes_back_to_the_connection(
    start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 100 KB of unfinished requests allowed per connection, 60 KB held past its deadline
    no longer counts: a second 60 KB request is held and then answered, not refused."""
    monkeypatch.setattr(h2conn, "_MAX_BUFFERED", 100_000)
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_request_timeout=0.3)
    raw = await Raw.connect(agent.rls_address)
    big = rls_pb2.RateLimitRequest(domain="edge")
    big.descriptors.add().entries.add(key="padding", value="p" * 60_000)
    message = grpc_message(big.SerializeToString())
    try:
        stuck, held = raw.stream(), message[:-1]
        raw.send(frame(FrameType.HEADERS, END_HEADERS, stuck, raw.block(request_fields())),
                 *(frame(FrameType.DATA, 0, stuck, held[i:i + 16384]) for i in range(0, len(held), 16384)))
        assert (await raw.answer(stuck)).status == DEADLINE_EXCEEDED
        sid = raw.stream()
        raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())),
                 *(frame(FrameType.DATA, 0, sid, message[i:i + 16384]) for i in range(0, len(message), 16384)))
        await round_trip(raw, b"held....")  # over 100 KB with the first: RESOURCE_EXHAUSTED before the ACK
        raw.send(frame(FrameType.DATA, END_STREAM, sid, b""))
        assert (await raw.answer(sid)).status == OK_STATUS
    finally:
        await raw.close()


async def test_a_reload_changes_the_deadline_of_later_requests_not_of_open_ones(
    start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request keeps the deadline it was given at its HEADERS, and its answer names that
    one: after a reload to 2 s, a request opened under 5 s was answered "within 2 s" (at 5 s)."""
    clock = FakeClock()
    monkeypatch.setattr(h2c, "CLOCK", clock)
    agent = await start_agent(**rls_options(tmp_path, EDGE), rls_request_timeout=5.0)
    raw = await Raw.connect(agent.rls_address)
    try:
        before = unfinished(raw)
        await round_trip(raw, b"ping-one")
        agent.config = replace(agent.config, rls_request_timeout=2.0)  # what SIGHUP's reload does
        after = unfinished(raw)
        await round_trip(raw, b"ping-two")
        clock.now += 2.1
        raw.send(frame(FrameType.PING, 0, 0, b"ping-3.."))
        answer = await raw.answer(after)
        assert answer.status == DEADLINE_EXCEEDED
        assert ("grpc-message", "request not complete within 2 s") in answer.headers
        await round_trip(raw, b"ping-4..")
        assert before not in raw.ended, "still within its 5 s"
        clock.now += 3.0
        raw.send(frame(FrameType.PING, 0, 0, b"ping-5.."))
        answer = await raw.answer(before)
        assert answer.status == DEADLINE_EXCEEDED
        assert ("grpc-message", "request not complete within 5 s") in answer.headers
    finally:
        await raw.close()

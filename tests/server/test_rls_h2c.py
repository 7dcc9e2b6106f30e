"""The rate limit service's HTTP/2 fast path (geolimit/server/rls/h2c.py) against hostile and odd clients.

A real agent on a real Redis; a raw HTTP/2 client (tests/server/h2raw.py) sends
what a test needs, valid or not. After each misbehaving client, a well-behaved
grpcio client must still get its decision: bad bytes cost their own connection only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
import redis.asyncio
from envoy.service.ratelimit.v3 import rls_pb2

from geolimit.server.agent import Agent
from geolimit.server.rls import h2c, h2conn
from geolimit.server.rls.h2wire import (
    END_HEADERS,
    END_STREAM,
    PADDED,
    PRIORITY_FLAG,
    Error,
    FrameType,
    Settings,
    frame,
    hpack_int,
)
from geolimit.server.rls.server import METHOD, SERVICE
from tests.server.conftest import StartAgent
from tests.server.h2raw import Raw, grpc_message, request_fields, rls_request
from tests.server.test_rls import EDGE, Client, rls_options

OK_STATUS, UNIMPLEMENTED, RESOURCE_EXHAUSTED, INTERNAL = 0, 12, 8, 13


@pytest.fixture
async def agent(start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Agent:
    monkeypatch.setattr(h2c, "FRAME_TIMEOUT", 1.0)  # slow senders are cut off after 1 s here
    return await start_agent(**rls_options(tmp_path, EDGE))


@pytest.fixture
async def raw(agent: Agent) -> AsyncIterator[Raw]:
    client = await Raw.connect(agent.rls_address)
    yield client
    await client.close()


async def healthy(agent: Agent) -> None:
    """A well-behaved grpcio client gets a decision."""
    host, port = agent.rls_address
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        code, _ = await Client(channel).codes("edge", [("remote_address", "10.1.1.1")])
        assert code == rls_pb2.RateLimitResponse.OK


def decision(data: bytes) -> int:
    code: int = rls_pb2.RateLimitResponse.FromString(data).overall_code
    return code


async def test_a_raw_call_is_answered_with_headers_message_and_trailers(raw: Raw) -> None:
    answer = await raw.answer(raw.call(rls_request()))
    assert dict(answer.headers) == {":status": "200", "content-type": "application/grpc"}
    assert answer.status == OK_STATUS
    assert decision(answer.message()) == rls_pb2.RateLimitResponse.OK
    raw.send(frame(FrameType.PING, 0, 0, b"12345678"))
    await asyncio.wait_for(_until(lambda: raw.pings == [b"12345678"], raw), 10)
    assert raw.settings_acks == 1, "the client's SETTINGS were acknowledged"


async def _until(done: Callable[[], bool], raw: Raw) -> None:
    while not done():
        await raw.frame()


async def test_padding_priority_and_continuation_are_understood(raw: Raw) -> None:
    block = raw.block(request_fields())
    sid = raw.stream()
    head = b"\x03" + b"\x00\x00\x00\x00\x10" + block[:5]  # pad length 3, priority (5 bytes), first bytes
    raw.send(frame(FrameType.HEADERS, PADDED | PRIORITY_FLAG, sid, head + b"\x00" * 3),
             frame(FrameType.CONTINUATION, 0, sid, block[5:9]),
             frame(FrameType.CONTINUATION, END_HEADERS, sid, block[9:]),
             frame(FrameType.PRIORITY, 0, sid, b"\x00\x00\x00\x00\x07"),
             frame(FrameType.DATA, PADDED, sid, b"\x04" + grpc_message(rls_request())[:3] + b"\x00" * 4),
             frame(FrameType.DATA, PADDED | END_STREAM, sid, b"\x00" + grpc_message(rls_request())[3:]))
    answer = await raw.answer(sid)
    assert answer.status == OK_STATUS
    assert decision(answer.message()) == rls_pb2.RateLimitResponse.OK


@pytest.mark.parametrize(("bytes_sent", "code"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Error.PROTOCOL_ERROR),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(FrameType.PING, 0, 0, b"12345678"), Error.PROTOCOL_ERROR),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, Error.PROTOCOL_ERROR),  # a TLS hello
])
async def test_a_bad_preface_gets_goaway(agent: Agent, bytes_sent: bytes, code: int) -> None:
    client = await Raw.connect(agent.rls_address, preface=False)
    client.send(bytes_sent)
    assert await client.goaway() == code
    await healthy(agent)


@pytest.mark.parametrize(("bad", "code"), [
    (frame(FrameType.DATA, 0, 0, b"x"), Error.PROTOCOL_ERROR),
    (frame(FrameType.DATA, 0, 7, b"x"), Error.PROTOCOL_ERROR),  # an idle stream
    (frame(FrameType.HEADERS, END_HEADERS, 2, b"\x82"), Error.PROTOCOL_ERROR),  # an even stream id
    (frame(FrameType.HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), Error.COMPRESSION_ERROR),
    (frame(FrameType.HEADERS, PADDED | END_HEADERS, 1, b"\x09abc"), Error.PROTOCOL_ERROR),  # padding > frame
    (frame(FrameType.SETTINGS, 0, 0, b"\x00\x04\x00"), Error.FRAME_SIZE_ERROR),
    (frame(FrameType.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x10"), Error.PROTOCOL_ERROR),  # max frame 16
    (frame(FrameType.SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"), Error.FLOW_CONTROL_ERROR),
    (frame(FrameType.SETTINGS, 1, 0, b"\x00\x04\x00\x00\x00\x00"), Error.FRAME_SIZE_ERROR),  # an ACK with data
    (frame(FrameType.PING, 0, 0, b"1234"), Error.FRAME_SIZE_ERROR),
    (frame(FrameType.PING, 0, 1, b"12345678"), Error.PROTOCOL_ERROR),
    (frame(FrameType.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), Error.PROTOCOL_ERROR),
    (frame(FrameType.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"), Error.FLOW_CONTROL_ERROR),
    (frame(FrameType.RST_STREAM, 0, 9, b"\x00\x00\x00\x08"), Error.PROTOCOL_ERROR),  # an idle stream
    (frame(FrameType.PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02\x82"), Error.PROTOCOL_ERROR),
    (frame(FrameType.CONTINUATION, END_HEADERS, 1, b"\x82"), Error.PROTOCOL_ERROR),
    (b"\x00\x40\x01\x00\x00\x00\x00\x00\x00", Error.FRAME_SIZE_ERROR),  # 16,385 bytes announced
])
async def test_a_bad_frame_gets_goaway_and_the_agent_serves_on(agent: Agent, raw: Raw, bad: bytes, code: int) -> None:
    raw.send(bad)
    assert await raw.goaway() == code
    await healthy(agent)


async def test_headers_on_a_stream_then_another_frame_is_a_protocol_error(agent: Agent, raw: Raw) -> None:
    block = raw.block(request_fields())
    raw.send(frame(FrameType.HEADERS, 0, 1, block[:4]), frame(FrameType.PING, 0, 0, b"12345678"))
    assert await raw.goaway() == Error.PROTOCOL_ERROR
    await healthy(agent)


async def test_a_header_list_over_the_limit_is_resource_exhausted(agent: Agent, raw: Raw) -> None:
    sid = raw.stream()
    fields = request_fields(METHOD, *((f"x-pad-{i}", "v" * 1000) for i in range(20)))  # 20 KB decoded
    raw.send(raw.headers(sid, fields), frame(FrameType.DATA, END_STREAM, sid, grpc_message(rls_request())))
    answer = await raw.answer(sid)
    assert answer.status == RESOURCE_EXHAUSTED
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS, "the connection serves on"


async def test_a_header_block_over_64_kib_ends_the_connection(agent: Agent, raw: Raw) -> None:
    sid = raw.stream()
    block = raw.block(request_fields())
    raw.send(frame(FrameType.HEADERS, 0, sid, block),
             *(frame(FrameType.CONTINUATION, 0, sid, b"\x00" * 16384) for _ in range(5)))
    assert await raw.goaway() == Error.ENHANCE_YOUR_CALM
    await healthy(agent)


async def test_an_hpack_bomb_ends_the_connection(agent: Agent, raw: Raw) -> None:
    # one 4 KB field into the dynamic table, then referenced 100 times: 400 KB from a 4 KB block
    insert = b"\x40" + hpack_int(5, 7, 0) + b"x-big" + hpack_int(4000, 7, 0) + b"b" * 4000
    raw.send(frame(FrameType.HEADERS, END_HEADERS, raw.stream(), insert + b"\xbe" * 100))
    assert await raw.goaway() == Error.ENHANCE_YOUR_CALM
    await healthy(agent)


async def test_a_message_over_the_limit_is_refused_before_it_is_buffered(agent: Agent, raw: Raw) -> None:
    sid = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())),
             frame(FrameType.DATA, 0, sid, b"\x00" + (h2c.MAX_MESSAGE + 1).to_bytes(4, "big") + b"x" * 1000))
    answer = await raw.answer(sid)
    assert answer.status == RESOURCE_EXHAUSTED
    raw.send(frame(FrameType.DATA, END_STREAM, sid, b"y" * 1000))  # the rest: dropped, not an error
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS


async def test_unfinished_requests_over_8_mib_on_a_connection_lose_the_largest(agent: Agent, raw: Raw) -> None:
    sids = [raw.stream() for _ in range(3)]
    declared = b"\x00" + (h2c.MAX_MESSAGE - 10).to_bytes(4, "big")
    for n, sid in enumerate(sids):
        raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())))
        chunk = declared + b"x" * (16384 - 5)
        raw.send(*(frame(FrameType.DATA, 0, sid, chunk if i == 0 else b"x" * 16384) for i in range(180 + n)))
    # 2.9-3.0 MB each: the third one's last frames pass 8 MiB, when the second holds the most
    assert (await raw.answer(sids[1])).status == RESOURCE_EXHAUSTED
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
    assert not raw.ended & {sids[0], sids[2]}, "the others go on"
    await healthy(agent)


async def test_unfinished_requests_over_the_budget_of_all_connections_lose_the_largest(
    agent: Agent, raw: Raw, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each connection kept under its own 8 MiB: 60 connections of 2 x 4 MiB unfinished requests
    took an agent to 760 MiB. Past the budget of all connections (64 MiB; 4 MiB here), the
    connection whose data passes it loses its largest unfinished request."""
    monkeypatch.setattr(h2conn, "_MAX_BUFFERED_ALL", 4 << 20)
    other = await Raw.connect(agent.rls_address)
    try:
        declared = b"\x00" + (h2c.MAX_MESSAGE - 10).to_bytes(4, "big")
        sids = []
        for client in (raw, other):  # 3 MB each, unfinished: the second passes 4 MiB in all
            sid = client.stream()
            sids.append(sid)
            client.send(frame(FrameType.HEADERS, END_HEADERS, sid, client.block(request_fields())))
            chunk = declared + b"x" * (16384 - 5)
            client.send(*(frame(FrameType.DATA, 0, sid, chunk if i == 0 else b"x" * 16384) for i in range(180)))
            await client.writer.drain()
            if client is raw:
                assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS  # the first one is held
        assert (await other.answer(sids[1])).status == RESOURCE_EXHAUSTED
        assert sids[0] not in raw.ended, "the first connection's request goes on"
        await healthy(agent)
    finally:
        await other.close()


@pytest.mark.parametrize(("body", "status"), [
    (b"", UNIMPLEMENTED),  # no message
    (grpc_message(rls_request(), flag=1), UNIMPLEMENTED),  # compressed
    (grpc_message(rls_request()) * 2, INTERNAL),  # two messages
    (grpc_message(rls_request())[:-1], INTERNAL),  # a message cut short
    (grpc_message(b"\xff\xff\xff"), 3),  # not a RateLimitRequest: INVALID_ARGUMENT from the service
])
async def test_bodies_other_than_one_plain_message_are_refused(raw: Raw, body: bytes, status: int) -> None:
    sid = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())),
             frame(FrameType.DATA, END_STREAM, sid, body))
    assert (await raw.answer(sid)).status == status


@pytest.mark.parametrize(("fields", "status"), [
    (request_fields(f"/{SERVICE}/Other"), UNIMPLEMENTED),
    (request_fields(METHOD, ("grpc-encoding", "gzip")), UNIMPLEMENTED),
    ([(n, "GET" if n == ":method" else v) for n, v in request_fields()], UNIMPLEMENTED),
    ([(n, "text/plain" if n == "content-type" else v) for n, v in request_fields()], UNIMPLEMENTED),
])
async def test_other_methods_and_encodings_are_unimplemented(raw: Raw, fields: list[tuple[str, str]],
                                                             status: int) -> None:
    sid = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(fields)),
             frame(FrameType.DATA, END_STREAM, sid, grpc_message(rls_request())))
    assert (await raw.answer(sid)).status == status


async def test_a_malformed_request_is_reset(raw: Raw) -> None:
    sid = raw.stream()
    fields = [f for f in request_fields() if f[0] != ":path"]
    raw.send(frame(FrameType.HEADERS, END_HEADERS | END_STREAM, sid, raw.block(fields)))
    assert (await raw.answer(sid)).reset == Error.PROTOCOL_ERROR
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS


async def test_answers_wait_for_the_clients_windows(agent: Agent) -> None:
    client = await Raw.connect(agent.rls_address, {Settings.INITIAL_WINDOW_SIZE: 0})
    try:
        sid = client.call(rls_request())
        kind, flags, stream, _ = await client.frame()
        while kind != FrameType.HEADERS:  # the SETTINGS and WINDOW_UPDATE of the server's preface
            kind, flags, stream, _ = await client.frame()
        assert (stream, flags & END_STREAM) == (sid, 0), "the answer's headers, its message held back"
        client.send(frame(FrameType.WINDOW_UPDATE, 0, sid, (10).to_bytes(4, "big")))
        kind, flags, stream, payload = await client.frame()
        assert (kind, stream, len(payload)) == (FrameType.DATA, sid, 10), "no more than the window"
        client.send(frame(FrameType.SETTINGS, 0, 0, Settings.INITIAL_WINDOW_SIZE.to_bytes(2, "big")
                          + (65535).to_bytes(4, "big")))
        answer = await client.answer(sid)
        assert answer.status == OK_STATUS
        assert decision((payload + answer.data)[5:]) == rls_pb2.RateLimitResponse.OK
    finally:
        await client.close()
    await healthy(agent)


async def refused_streams(raw: Raw, n: int) -> list[int]:
    """The next ``n`` streams the server resets, each with REFUSED_STREAM."""
    refused: list[int] = []
    while len(refused) < n:
        kind, _, sid, payload = await raw.frame()
        if kind == FrameType.RST_STREAM:
            assert int.from_bytes(payload, "big") == Error.REFUSED_STREAM
            refused.append(sid)
    return refused


async def test_streams_over_the_limit_are_refused_and_the_others_served(agent: Agent, raw: Raw) -> None:
    opened = [raw.stream() for _ in range(h2c.MAX_STREAMS + 10)]
    raw.send(*(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())) for sid in opened))
    assert await refused_streams(raw, 10) == opened[-10:]
    raw.send(*(frame(FrameType.DATA, END_STREAM, sid, grpc_message(rls_request(f"10.7.0.{i % 200}")))
               for i, sid in enumerate(opened[:h2c.MAX_STREAMS])))
    for sid in opened[:h2c.MAX_STREAMS]:
        assert (await raw.answer(sid)).status == OK_STATUS
    await healthy(agent)


async def test_resets_of_calls_in_progress_count_against_the_stream_limit(agent: Agent, raw: Raw) -> None:
    """Rapid reset: requests reset as soon as they are sent cannot pile up decisions."""
    admin = redis.asyncio.Redis.from_url(agent.config.redis_url)
    try:
        await admin.execute_command("CLIENT", "PAUSE", "4000", "ALL")  # every decision waits 4 s in Redis
        sent = [raw.stream() for _ in range(h2c.MAX_STREAMS + 10)]
        raw.send(*(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())) + frame(
            FrameType.DATA, END_STREAM, sid, grpc_message(rls_request(f"10.8.0.{i % 200}"))) + frame(
            FrameType.RST_STREAM, 0, sid, Error.CANCEL.to_bytes(4, "big")) for i, sid in enumerate(sent)))
        assert await refused_streams(raw, 10) == sent[-10:], "the reset calls being decided held the limit"
    finally:
        await admin.aclose()
    # Once Redis answers, the reset calls end (their answers are dropped) and the
    # connection takes new calls again: refused until then.
    deadline = asyncio.get_running_loop().time() + 30
    answer = await raw.answer(raw.call(rls_request()))
    while answer.reset == Error.REFUSED_STREAM and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        answer = await raw.answer(raw.call(rls_request()))
    assert answer.status == OK_STATUS
    await healthy(agent)


async def test_a_call_reset_mid_way_is_dropped_and_the_connection_serves_on(agent: Agent, raw: Raw) -> None:
    sid = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, sid, raw.block(request_fields())),
             frame(FrameType.DATA, 0, sid, grpc_message(rls_request())[:4]),
             frame(FrameType.RST_STREAM, 0, sid, (Error.CANCEL).to_bytes(4, "big")))
    done = raw.call(rls_request())  # reset after its message: answered or not, nothing breaks
    late = raw.stream()
    raw.send(frame(FrameType.HEADERS, END_HEADERS, late, raw.block(request_fields())),
             frame(FrameType.DATA, END_STREAM, late, grpc_message(rls_request())),
             frame(FrameType.RST_STREAM, 0, late, (Error.CANCEL).to_bytes(4, "big")))
    assert (await raw.answer(done)).status == OK_STATUS
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
    await healthy(agent)


@pytest.mark.parametrize("sent", [b"PRI * HTTP/2.0\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x06\x04"])
async def test_a_half_written_frame_or_preface_is_cut_off(agent: Agent, sent: bytes) -> None:
    client = await Raw.connect(agent.rls_address, preface=False)
    client.send(sent)
    started = asyncio.get_running_loop().time()
    await healthy(agent)
    assert await client.goaway() == Error.PROTOCOL_ERROR
    assert asyncio.get_running_loop().time() - started < 8
    await client.close()


async def test_a_slowloris_trickling_one_byte_at_a_time_is_cut_off(agent: Agent, raw: Raw) -> None:
    head = frame(FrameType.HEADERS, END_HEADERS, 1, raw.block(request_fields()) + b"\x00" * 500)

    async def trickle() -> None:
        for byte in head:
            raw.send(bytes((byte,)))
            await asyncio.sleep(0.05)

    task = asyncio.ensure_future(trickle())
    try:
        await healthy(agent)
        assert await raw.goaway() == Error.PROTOCOL_ERROR, "cut off well before its frame is complete"
        assert not task.done()
    finally:
        task.cancel()


async def test_stop_sends_goaway_and_answers_the_calls_in_progress(agent: Agent, raw: Raw) -> None:
    assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
    assert agent.rls is not None
    await agent.rls.stop(1.0)
    assert await raw.goaway() == Error.NO_ERROR

"""The rate limit service's gRPC transport (grpcio's core driven directly), with grpcio's own client.

Through a real agent: another method, a request that does not parse. On the
transport alone: calls answered later from the loop, a graceful stop that waits
for them, a stop that cancels them (a late answer is then dropped, not a crash),
and a poller that crashes (logged, and raised by stop()).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from geolimit.errors import GeolimitError
from geolimit.server.agent import Agent
from geolimit.server.rls import transport
from geolimit.server.rls.server import METHOD, SERVICE
from geolimit.server.rls.transport import StatusCode, UnaryCall, UnaryServer
from tests.server.conftest import StartAgent
from tests.server.test_rls import EDGE, request, rls_options
from tests.support.regions import eventually


@pytest.fixture
async def channel(start_agent: StartAgent, tmp_path: Path, rls_fast_path: bool) -> AsyncIterator[grpc.aio.Channel]:
    agent: Agent = await start_agent(**rls_options(tmp_path, EDGE, fast=rls_fast_path))
    host, port = agent.rls_address
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        yield channel


async def test_another_method_is_unimplemented(channel: grpc.aio.Channel) -> None:
    other = channel.unary_unary(f"/{SERVICE}/Other")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await other(b"", timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_request_that_does_not_parse_is_invalid_argument(channel: grpc.aio.Channel) -> None:
    raw = channel.unary_unary(METHOD)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(b"\xff\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RateLimitRequest" in (caught.value.details() or "")
    answer = rls_pb2.RateLimitResponse.FromString(await raw(request("edge", [("internal", "x")]).SerializeToString(),
                                                            timeout=10))
    assert answer.overall_code == rls_pb2.RateLimitResponse.OK, "the raw bytes are the same message"


class Held:
    """A handler that keeps its calls until told to answer them."""

    def __init__(self) -> None:
        self.calls: list[UnaryCall] = []

    def __call__(self, call: UnaryCall) -> None:
        self.calls.append(call)

    async def until(self, n: int) -> None:
        await eventually(lambda: len(self.calls) >= n, what=f"{n} calls arrived")


async def serve(handler: Held) -> tuple[UnaryServer, str]:
    server = UnaryServer("/test.Echo/Call", handler)
    port = server.bind("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_answers_from_the_loop_in_any_order_and_a_graceful_stop_waits() -> None:
    held = Held()
    server, target = await serve(held)
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.unary_unary("/test.Echo/Call")
        pending = [asyncio.ensure_future(call(b"%d" % i, timeout=10)) for i in range(3)]
        await held.until(3)
        by_request = {c.request: c for c in held.calls}
        by_request[b"2"].reply(b"two:" + by_request[b"2"].request)
        by_request[b"0"].fail(StatusCode.INVALID_ARGUMENT, "nope")
        assert await pending[2] == b"two:2"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pending[0]
        assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "nope")
        stopping = asyncio.ensure_future(server.stop(10))

        async def refused() -> bool:  # the stop is under way: no new call
            try:
                await call(b"new", timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code() == grpc.StatusCode.UNAVAILABLE
            return False

        await eventually(refused, what="new calls refused")
        assert not stopping.done(), "the call in progress holds the stop"
        by_request[b"1"].reply(b"late")
        assert await pending[1] == b"late"
        await asyncio.wait_for(stopping, 10)
    assert server.closed


async def test_leaving_async_with_cancels_and_a_later_answer_is_dropped() -> None:
    held = Held()
    server = UnaryServer("/test.Echo/Call", held)
    port = server.bind("127.0.0.1:0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        async with server:
            pending = asyncio.ensure_future(ch.unary_unary("/test.Echo/Call")(b"x", timeout=10))
            await held.until(1)
        assert server.closed
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pending
        assert caught.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    held.calls[0].reply(b"too late")  # the queue is gone: nothing happens (grpcio's core would abort)
    await server.stop(None)  # again: nothing to do


async def test_a_crashed_poller_is_logged_and_raised_by_stop(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(queue: Any) -> Any:
        raise RuntimeError("poller broke")

    monkeypatch.setattr(transport, "queue_poll", broken)
    server, _ = await serve(Held())
    with caplog.at_level(logging.CRITICAL, logger="geolimit.agent"):
        await eventually(lambda: any("poller crashed" in r.getMessage() for r in caplog.records),
                         what="the crash logged")
    with pytest.raises(GeolimitError, match="poller crashed"):
        await asyncio.wait_for(server.stop(1), 10)


async def test_an_agent_whose_poller_crashed_still_stops_then_raises(
    start_agent: StartAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(queue: Any) -> Any:
        raise RuntimeError("poller broke")

    monkeypatch.setattr(transport, "queue_poll", broken)
    agent = await start_agent(**rls_options(tmp_path, EDGE, fast=False))
    with pytest.raises(GeolimitError, match="poller crashed"):
        await asyncio.wait_for(agent.stop(), 10)
    assert not agent._runners, "the HTTP listeners are closed all the same"

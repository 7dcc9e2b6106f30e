"""The rate limit service's HTTP/2 fast path holds at most ``max_connections`` connections.

Its listener had no cap, and a connection that sent the preface and then nothing was
held for ever (only an unfinished frame has a deadline): with RLIMIT_NOFILE 1024, 2000
such connections pinned an agent at 1024 file descriptors and every /v1/check on a new
connection failed, for as long as they stayed. A real agent on a real Redis, raw
HTTP/2 clients on real sockets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from geolimit.server.agent import Agent
from tests.server.conftest import StartAgent
from tests.server.h2raw import Raw, rls_request
from tests.server.test_rls import EDGE, rls_options
from tests.support.regions import eventually

OK_STATUS = 0


def _sample(agent: Agent, name: str, **labels: str) -> float:
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


def _open(agent: Agent) -> float:
    return _sample(agent, "geolimit_http_connections_open", listener="rls_listen")


async def test_connections_over_max_connections_are_closed_at_their_accept(
    start_agent: StartAgent, tmp_path: Path,
) -> None:
    agent = await start_agent(**rls_options(tmp_path, EDGE), max_connections=4)
    held = [await Raw.connect(agent.rls_address) for _ in range(4)]  # idle after their preface
    await eventually(lambda: _open(agent) == 4, what="the 4 connections counted")
    excess = [await Raw.connect(agent.rls_address) for _ in range(20)]
    for raw in excess:  # closed at once, before any frame
        assert await asyncio.wait_for(raw.reader.read(), 5) == b""
        await raw.close()
    assert _sample(agent, "geolimit_http_connections_dropped_total", listener="rls_listen",
                   reason="connection_limit") == 20
    assert (await held[0].answer(held[0].call(rls_request()))).status == OK_STATUS, "the admitted ones are served"
    await held[1].close()
    await eventually(lambda: _open(agent) == 3, what="a place given back")
    again = await Raw.connect(agent.rls_address)
    assert (await again.answer(again.call(rls_request()))).status == OK_STATUS
    for raw in [again, held[0], *held[2:]]:
        await raw.close()
    await eventually(lambda: _open(agent) == 0, what="every connection closed")


async def test_grpcio_transport_closes_connections_over_max_connections(
    start_agent: StartAgent, tmp_path: Path,
) -> None:
    """The same cap on the grpcio transport (``rls_fast_path = false``): its core closes
    the connections past ``max_connections`` (as of the start) and serves the others."""
    agent = await start_agent(**rls_options(tmp_path, EDGE, fast=False), max_connections=4)
    held = [await Raw.connect(agent.rls_address) for _ in range(4)]
    for raw in held:  # each served, so each is established in grpcio's core
        assert (await raw.answer(raw.call(rls_request()))).status == OK_STATUS
    excess = [await Raw.connect(agent.rls_address) for _ in range(10)]
    for raw in excess:
        assert await asyncio.wait_for(raw.reader.read(), 5) == b""
        await raw.close()
    assert (await held[0].answer(held[0].call(rls_request()))).status == OK_STATUS, "the admitted ones are served"
    await held[1].close()

    async def served() -> bool:
        raw = await Raw.connect(agent.rls_address)
        try:
            return (await asyncio.wait_for(raw.answer(raw.call(rls_request())), 2)).status == OK_STATUS
        except Exception:  # closed at its accept: the place is not back yet
            return False
        finally:
            await raw.close()

    await eventually(served, what="a place given back")
    for raw in [held[0], *held[2:]]:
        await raw.close()

"""A TLS listener's connection cap counts connections from their accept, handshake included.

The guard counted a connection when aiohttp got it, which on a TLS listener is after the
handshake: connections that never sent a ClientHello were not counted, so the cap did not
hold them. With RLIMIT_NOFILE 1024, 2000 such connections pinned a TLS agent at 1024 file
descriptors and failed every /healthz probe for the handshake timeout they each had.
Real agent on a real Redis, raw sockets and a real TLS client; asyncio's loop and uvloop.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import pytest
import uvloop

from geolimit.server.agent import Agent
from geolimit.server.config import TLSConfig
from tests.server.conftest import StartAgent
from tests.server.helpers import make_cert
from tests.support.regions import eventually

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


def _sample(agent: Agent, name: str, **labels: str) -> float:
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


def _open(agent: Agent) -> float:
    return _sample(agent, "geolimit_http_connections_open", listener="listen")


async def _silent(agent: Agent) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection that never starts its handshake."""
    host, port = agent.url.removeprefix("https://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _healthz(agent: Agent, context: ssl.SSLContext, requests: int = 1) -> list[int]:
    """``requests`` GET /healthz over one TLS connection kept alive."""
    statuses = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=1),
                                     timeout=aiohttp.ClientTimeout(total=5)) as session:
        for _ in range(requests):
            async with session.get(agent.url + "/healthz") as resp:
                await resp.read()
                statuses.append(resp.status)
    return statuses


async def test_connections_in_their_handshake_count_against_the_cap(start_agent: StartAgent, tmp_path: Path) -> None:
    cert = make_cert(tmp_path)
    agent = await start_agent(max_connections=4, head_timeout=30, tls=TLSConfig(cert.cert, cert.key, cert.cert))
    held = [await _silent(agent) for _ in range(4)]
    await eventually(lambda: _open(agent) == 4, what="the 4 handshakes counted")
    excess = [await _silent(agent) for _ in range(20)]
    for reader, writer in excess:  # closed at their accept, not held for a handshake
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    assert _sample(agent, "geolimit_http_connections_dropped_total", listener="listen",
                   reason="connection_limit") == 20
    with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
        await _healthz(agent, cert.client_context())
    held[0][1].transport.abort()  # a connection gone in its handshake gives its place back
    await eventually(lambda: _open(agent) == 3, what="the place given back")
    assert await _healthz(agent, cert.client_context(), 3) == [200, 200, 200], "kept alive over TLS"
    for _, writer in held[1:]:
        writer.transport.abort()
    await eventually(lambda: _open(agent) == 0, what="every connection closed")


async def test_a_handshake_past_the_deadline_gives_its_place_back(start_agent: StartAgent, tmp_path: Path) -> None:
    cert = make_cert(tmp_path)
    agent = await start_agent(max_connections=3, head_timeout=0.3, tls=TLSConfig(cert.cert, cert.key, cert.cert))
    stuck = [await _silent(agent) for _ in range(3)]
    stuck[0][1].write(b"\x16\x03\x01")  # a ClientHello that never ends
    for reader, writer in stuck:
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    await eventually(lambda: _open(agent) == 0, what="the timed-out handshakes released")
    assert await _healthz(agent, cert.client_context()) == [200]

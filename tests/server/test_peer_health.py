"""What /v1/status, /metrics and the log say about a peer that replication cannot reach:
one that refuses this region's signature (another secret), and one that stops answering
without closing its connections (blackholed: a loopback listener that accepts and never
answers). Real agents on loopback, a real redis-server each, one ManualClock for all."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from geolimit import Limiter, ManualClock, Rule
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis
from tests.support.agent_fixtures import agents
from tests.support.regions import Regions, dead_url, eventually

__all__ = ["agents"]  # fixtures

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 100, 10, 1)


@pytest.fixture
async def blackhole() -> AsyncIterator[str]:
    """The URL of a listener that accepts connections, reads, and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in held:
            writer.close()


async def get(agent: Agent, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(agent.url + path) as resp:
        return resp.status, await (resp.json() if path != "/metrics" else resp.text())


async def peer_b(agent: Agent, name: str = "b") -> dict[str, Any]:
    """``/v1/status`` of ``agent``: its peer ``name``."""
    _, status = await get(agent, "/v1/status")
    return status["peers"][name]  # type: ignore[no-any-return]


async def metric(agent: Agent, name: str) -> float:
    _, text = await get(agent, "/metrics")
    found = re.search(rf'^{name}\{{peer="b"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"{name} for peer b not in /metrics"
    return float(found.group(1))


def config(name: str, server: EmbeddedRedis, secret: bytes, peer: str, peer_url: str, **overrides: Any) -> AgentConfig:
    options: dict[str, Any] = {
        "region": name, "redis_url": server.url, "listen": ("127.0.0.1", 0), "secret": secret,
        "peers": (PeerConfig(peer, peer_url),), "rules": (API,), "interval": 0.02, "timeout": 2.0,
        "max_backoff": 0.1,
    }
    return AgentConfig(**(options | overrides))


async def start_pair(a: Agent, b: Agent, agents: list[Agent], b_names_a: str = "a") -> None:
    """Start a and b, each with the other's URL (b knows a as ``b_names_a``)."""
    agents += [a, b]
    for agent in (a, b):
        await agent.listen()
    a.set_peer_url("b", b.url)
    b.set_peer_url(b_names_a, a.url)
    for agent in (a, b):
        await agent.start()


async def test_a_peer_refusing_our_signature_is_shown_counted_and_warned_once_per_period(
    redis_server_factory: Factory, agents: list[Agent], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="geolimit.gossip")
    clock = ManualClock(time.time())
    a = Agent(config("a", redis_server_factory(), secrets.token_bytes(32), "b", dead_url()), clock=clock)
    b_config = config("b", redis_server_factory(), secrets.token_bytes(32), "a", dead_url())  # another secret
    b = Agent(b_config, clock=clock)
    await start_pair(a, b, agents)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("region a: peer b refuses this region's signature")]

    async def refused(at_least: int) -> bool:
        clock.advance(0.11)  # the next attempt is due after a backoff (ManualClock time)
        peer = await peer_b(a)
        return bool(peer["auth_refused"] and peer["auth_refusals"] >= at_least)

    await eventually(lambda: refused(1), what="a's first exchange with b refused")
    peer = await peer_b(a)
    assert "signature" in peer["auth_refused_reason"]
    assert peer["auth_refused_age"] is not None
    _, body = await get(a, "/v1/status")
    assert any("secret_file" in w and "peer b" in w for w in body["warnings"])
    assert await metric(a, "geolimit_peer_auth_refusals_total") >= 1
    assert await metric(a, "geolimit_peer_auth_refused") == 1
    # Readiness ignores peers (a region decides alone while its peers are out of reach): still ready.
    await eventually(lambda: _ready(a), what="a ready")
    assert len(warnings()) == 1
    assert "secret_file" in warnings()[0]
    # Refusals go on every backoff, and are counted; the warning comes once a minute (ManualClock time).
    first = peer["auth_refusals"]
    await eventually(lambda: refused(first + 5), what="five more refusals")
    assert len(warnings()) == 1
    clock.advance(60)

    async def warned_again() -> bool:
        clock.advance(0.11)
        return len(warnings()) == 2

    await eventually(warned_again, what="the next minute's warning")
    assert "since the last warning" in warnings()[1]

    # b gets the right secret and restarts on its port: a says so, and keeps the count.
    port = int(b.url.rsplit(":", 1)[1])
    await b.abort()
    fixed = Agent(replace(b_config, secret=a.config.secret, listen=("127.0.0.1", port)), clock=clock)
    agents.append(fixed)
    await fixed.listen()
    fixed.set_peer_url("a", a.url)
    await fixed.start()

    async def accepted() -> bool:
        clock.advance(0.11)
        return not (await peer_b(a))["auth_refused"]

    await eventually(accepted, what="a's exchanges accepted by b again")
    peer = await peer_b(a)
    assert peer["auth_refusals"] >= first + 5
    assert (await get(a, "/v1/status"))[1]["warnings"] == []
    assert await metric(a, "geolimit_peer_auth_refused") == 0


async def _ready(agent: Agent) -> bool:
    status, _ = await get(agent, "/readyz")
    return status == 200


async def test_a_blackholed_peer_lags_by_the_age_of_the_change_in_flight_to_it(
    redis_server_factory: Factory, agents: list[Agent], blackhole: str,
) -> None:
    """The message carrying the change waits in flight for the whole send timeout: it was
    counted nowhere (out of the outbox, not acknowledged), and the lag read 0."""
    clock = ManualClock(time.time())
    server = redis_server_factory()
    a = Agent(config("a", server, secrets.token_bytes(32), "b", blackhole, timeout=60.0), clock=clock)
    agents.append(a)
    await a.start()
    await eventually(lambda: bool(a.engine is not None and a.engine.own_slots), what="a's first round")
    app = Limiter.from_url(server.url, region="a", rules=[API], clock=clock)
    try:
        assert app.hit("api", "user:1").allowed
    finally:
        app.close()

    engine = a.engine
    assert engine is not None
    await eventually(lambda: sum(engine.peers["b"].flight_keys.values()) == 1, what="the change in flight to b",
                     explain=lambda: peer_b(a))
    rounds = engine.stats["rounds"]
    await eventually(lambda: engine.stats["rounds"] >= rounds + 2, what="two more rounds (drains) while it is in flight")
    clock.advance(30)
    assert (await peer_b(a))["lag"] >= 30
    assert await metric(a, "geolimit_peer_lag_seconds") >= 30
    clock.advance(15)
    assert (await peer_b(a))["lag"] >= 45
    peer = await peer_b(a)
    assert peer["outbox"] == 1  # the change, in flight
    assert peer["consecutive_failures"] == 0  # nothing timed out yet


async def test_an_idle_region_shows_the_time_since_a_blackholed_peer_last_acknowledged(
    redis_server_factory: Factory, blackhole: str,
) -> None:
    """Nothing to send, and b stops answering: its heartbeats time out, and the lag grows
    from b's last acknowledgement (it read 0: no change waited for b)."""
    clock = ManualClock(time.time())
    async with Regions(redis_server_factory, ["a", "b"], [API], interval=0.02, clock=clock, timeout=0.5,
                       max_backoff=0.1) as rs:
        a = rs["a"].agent

        async def contact() -> bool:
            clock.advance(0.05)
            return (await peer_b(a))["last_contact"] is not None

        await eventually(contact, what="a first exchange between a and b")
        a.set_peer_url("b", blackhole)  # b's process stops answering, its connections stay open
        last_contact = (await peer_b(a))["last_contact"]

        async def failing() -> bool:
            clock.advance(0.3)  # the next heartbeat is due
            return bool((await peer_b(a))["consecutive_failures"] >= 1)

        await eventually(failing, what="a's heartbeat to b timed out")
        assert (await peer_b(a))["last_contact"] == last_contact
        clock.advance(30)
        lag = (await peer_b(a))["lag"]
        assert lag >= clock() - last_contact - 0.01
        assert lag >= 30
        assert await metric(a, "geolimit_peer_lag_seconds") >= 30
        assert (await peer_b(rs["b"].agent, "a"))["lag"] < 30  # b's side: it still reaches a


async def test_a_peer_that_names_this_region_otherwise_is_not_reported_as_a_wrong_secret(
    redis_server_factory: Factory, agents: list[Agent], caplog: pytest.LogCaptureFixture,
) -> None:
    """b's config names its peer "aa" (a is "a"); the secrets are the same. a's warning and
    /v1/status said "every region's secret_file must hold the same secret": they now say the
    names must match."""
    caplog.set_level(logging.WARNING, logger="geolimit.gossip")
    clock = ManualClock(time.time())
    secret = secrets.token_bytes(32)
    a = Agent(config("a", redis_server_factory(), secret, "b", dead_url()), clock=clock)
    b = Agent(config("b", redis_server_factory(), secret, "aa", dead_url()), clock=clock)
    await start_pair(a, b, agents, b_names_a="aa")

    async def refused() -> bool:
        clock.advance(0.11)
        return bool((await peer_b(a))["auth_refused"])

    await eventually(refused, what="a's exchange with b refused")
    assert "unknown region 'a'" in (await peer_b(a))["auth_refused_reason"]
    _, body = await get(a, "/v1/status")
    named = [w for w in body["warnings"] if "peer b" in w]
    assert named
    assert all("must name this region 'a' exactly" in w and "secret_file" not in w for w in named)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("region a: peer b")]
    assert logged
    assert "does not know this region's name" in logged[0]
    assert "secret_file" not in logged[0]

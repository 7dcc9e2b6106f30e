"""Fixtures of the agent server tests: a fresh Redis per test and agents started on loopback."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from geolimit import Rule
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis
from tests.support.cli_fixtures import http, running, supervisors
from tests.support.regions import dead_url, eventually

RULES = (Rule("api", 5, 10, 1), Rule("tiny", 2, 10, 1), Rule("hourly", 100, 3600, 360))
StartAgent = Callable[..., Awaitable[Agent]]

__all__ = ["RULES", "StartAgent", "http", "running", "supervisors"]  # the last three: fixtures shared with tests/proxy


@pytest.fixture
def region_redis(redis_server_factory: Callable[..., EmbeddedRedis]) -> Iterator[EmbeddedRedis]:
    """A redis-server of its own for this test (tests stop and restart it)."""
    server = redis_server_factory()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=[True, False], ids=["h2c", "grpcio"])
def rls_fast_path(request: pytest.FixtureRequest) -> bool:
    """Each transport of the rate limit service: the HTTP/2 fast path, then grpcio's core."""
    return bool(request.param)


@pytest.fixture
async def start_agent(region_redis: EmbeddedRedis) -> AsyncIterator[StartAgent]:
    """``await start_agent(run=True, **AgentConfig overrides)``: region "a" with one peer, "b", that is down."""
    agents: list[Agent] = []

    async def start(*, run: bool = True, **overrides: Any) -> Agent:
        options: dict[str, Any] = {
            "region": "a", "redis_url": region_redis.url, "listen": ("127.0.0.1", 0),
            "secret": secrets.token_bytes(32), "peers": (PeerConfig("b", dead_url()),), "rules": RULES,
            "interval": 0.05, "timeout": 1.0, "max_backoff": 0.5,
        }
        agent = Agent(AgentConfig(**(options | overrides)))
        agents.append(agent)
        await (agent.start() if run else agent.listen())
        if run:  # hits are queued for peers once the first round holds the lease
            await eventually(lambda: bool(agent.engine is not None and agent.engine.own_slots),
                             what="the agent's first round")
        return agent

    try:
        yield start
    finally:
        for agent in agents:
            await agent.abort()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s

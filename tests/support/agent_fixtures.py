"""Fixtures of the tests that run agents in-process (tests/server, tests/proxy).

A test module (or conftest.py) imports the ones it uses and names them in its ``__all__``.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence

import pytest

from geolimit import ManualClock, Rule
from geolimit.http.agent_client import AgentClient
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import dead_url

__all__ = ["agent_client", "agents"]


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            await agent.abort()


@contextlib.asynccontextmanager
async def agent_client(server: EmbeddedRedis, rules: Sequence[Rule],
                       rule_groups: dict[str, tuple[str, ...]]) -> AsyncIterator[AgentClient]:
    """An AgentClient of a listening agent of region "a" (its peer b unreachable) on ``server``,
    under a manual clock; the agent and the server stop at the end."""
    agent = Agent(AgentConfig(region="a", redis_url=server.url, listen=("127.0.0.1", 0),
                              secret=secrets.token_bytes(32), peers=(PeerConfig("b", dead_url()),), rules=tuple(rules),
                              rule_groups=rule_groups),
                  clock=ManualClock(1_700_000_000.25))
    await agent.listen()
    made = AgentClient(agent.url)
    try:
        yield made
    finally:
        await made.close()
        await agent.abort()
        server.stop()

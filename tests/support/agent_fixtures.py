"""Fixtures of the tests that run agents in-process (tests/server, tests/proxy).

A test module (or conftest.py) imports the ones it uses and names them in its ``__all__``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from geolimit.server.agent import Agent

__all__ = ["agents"]


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            await agent.abort()

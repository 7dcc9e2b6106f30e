"""Fixtures of the tests that run ``geolimit agent`` and ``geolimit proxy`` as processes (tests/server, tests/proxy).

A test module (or conftest.py) imports the ones it uses and names them in its ``__all__``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support.cli_process import CliProcess, any_worker_session, stop_all

__all__ = ["http", "running", "supervisors"]


@pytest.fixture
async def running() -> AsyncIterator[list[CliProcess]]:
    """Processes started by the test; killed at teardown if still running."""
    procs: list[CliProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            await proc.kill()


@pytest.fixture
async def supervisors() -> AsyncIterator[list[CliProcess]]:
    """`--workers N` supervisors started by the test: stopped (SIGTERM, so they stop their
    workers) at teardown if still running, then killed."""
    procs: list[CliProcess] = []
    try:
        yield procs
    finally:
        await stop_all(procs)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request, so requests land on any worker sharing a port."""
    async with any_worker_session() as s:
        yield s

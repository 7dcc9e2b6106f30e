"""An overloaded agent: checks beyond ``[region] max_checks_in_progress`` are answered 503 at once.

Without the bound an agent offered more checks than it can decide queued them all: with 4000
in flight it held seconds of decisions, its gossip rounds slowed from 10 to 1-3 a second and
its peers' counts grew older than ``partition_after`` (docs/design.md §14, *Overload*).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geolimit import AsyncLimiter, Rule
from geolimit.errors import ConfigError
from geolimit.server.config import parse_config
from geolimit.store.embedded import EmbeddedRedis
from tests.server.conftest import StartAgent
from tests.server.helpers import AgentProcess, dump_toml, region_config, write_secret
from tests.support.regions import dead_url, eventually

BODY = {"rule": "api", "subject": "user:42"}


async def _post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict[str, Any], Any]:
    async with session.post(url + "/v1/check", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_checks_beyond_the_bound_get_503_with_retry_after_at_once(
    start_agent: StartAgent, region_redis: EmbeddedRedis, session: aiohttp.ClientSession
) -> None:
    """Redis paused (bound 4): 3 checks wait inside the agent, a batch of 10 is still taken whole
    (never starved by a smaller bound), then one more check is answered 503 before Redis answers
    anything; once Redis is back all of them are decided."""
    agent = await start_agent(max_checks_in_progress=4)
    admin = region_redis.client()
    assert (await _post(session, agent.api_url, BODY))[0] == 200
    batch = [{"rule": "api", "subject": f"user:{i}"} for i in range(10)]
    admin.client_pause(20_000, all=False)  # hit.lua waits; the test unpauses it
    try:
        waiting = [asyncio.ensure_future(_post(session, agent.api_url, BODY)) for _ in range(3)]
        await eventually(lambda: agent.checks.in_progress == 3, what="3 checks in progress")
        waiting.append(asyncio.ensure_future(_post(session, agent.api_url, batch)))
        await eventually(lambda: agent.checks.in_progress == 13, what="the batch taken whole")
        began = time.monotonic()
        status, headers, body = await _post(session, agent.api_url, BODY)
        assert time.monotonic() - began < 2.0, "answered at once, not after the paused Redis"
        assert status == 503
        assert headers["Retry-After"] == "1"
        assert body["reason"] == "overloaded"
        assert "max_checks_in_progress" in body["error"]
        assert not any(w.done() for w in waiting)
        async with session.get(agent.api_url + "/v1/status") as resp:  # the status is not held back
            assert (await resp.json())["checks"] == {"in_progress": 13, "max": 4, "shed": 1}
    finally:
        admin.client_unpause()
    answers = await asyncio.gather(*waiting)
    assert [a[0] for a in answers] == [200] * 4
    assert len(answers[-1][2]["results"]) == 10
    assert agent.checks.in_progress == 0
    async with session.get(agent.api_url + "/metrics") as resp:
        assert "geolimit_checks_shed_total 1.0" in await resp.text()
    assert (await _post(session, agent.api_url, BODY))[0] == 200


async def test_a_reload_applies_a_new_bound(start_agent: StartAgent, session: aiohttp.ClientSession) -> None:
    agent = await start_agent(max_checks_in_progress=4)
    await agent.reload(replace(agent.config, max_checks_in_progress=7))  # what SIGHUP does with the re-read file
    async with session.get(agent.api_url + "/v1/status") as resp:
        assert (await resp.json())["checks"]["max"] == 7


def test_max_checks_in_progress_is_a_positive_integer(tmp_path: Path) -> None:
    write_secret(tmp_path / "gossip.key")
    data = region_config("redis://127.0.0.1:6379/0")
    assert parse_config(data, tmp_path / "region.toml").max_checks_in_progress == 512
    data["region"]["max_checks_in_progress"] = 64
    assert parse_config(data, tmp_path / "region.toml").max_checks_in_progress == 64
    for bad in (0, -1, 1.5, "64", True):
        data["region"]["max_checks_in_progress"] = bad
        with pytest.raises(ConfigError, match=r"region\.max_checks_in_progress must be a positive integer"):
            parse_config(data, tmp_path / "region.toml")


@pytest.fixture
async def two_regions(tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis],
                      running: list[AgentProcess]) -> AsyncIterator[dict[str, tuple[str, EmbeddedRedis]]]:
    """Agent processes a (max_checks_in_progress = 16) and b, gossiping every 100 ms."""
    secret = secrets.token_hex(32).encode()
    servers = {name: redis_server_factory() for name in "ab"}
    ports = {name: int(dead_url().rsplit(":", 1)[1]) for name in "ab"}
    out: dict[str, tuple[str, EmbeddedRedis]] = {}
    try:
        for name, other in (("a", "b"), ("b", "a")):
            folder = tmp_path / name
            folder.mkdir()
            write_secret(folder / "gossip.key", secret)
            data = region_config(servers[name].url, name=name, listen=f"127.0.0.1:{ports[name]}",
                                 peers=[{"name": other, "url": f"http://127.0.0.1:{ports[other]}"}],
                                 rules=[{"name": "api", "limit": 1_000_000, "window": 10, "resolution": 1}],
                                 interval=0.1)
            if name == "a":
                data["region"]["max_checks_in_progress"] = 16
            (folder / "region.toml").write_text(dump_toml(data))
            agent = await AgentProcess.start(folder / "region.toml", "--flush-timeout", "1")
            running.append(agent)
            out[name] = (await agent.url(), servers[name])
        yield out
    finally:
        for server in servers.values():
            server.stop()


async def test_an_overloaded_agent_sheds_checks_and_keeps_gossiping(
    two_regions: dict[str, tuple[str, EmbeddedRedis]],
) -> None:
    """200 clients at once on a (bound 16) for 3 s: a answers each 200 or 503 with Retry-After, and
    b's hits keep reaching a's Redis within 5 s while it does (each probe is a fresh subject)."""
    (url_a, redis_a), (url_b, _) = two_regions["a"], two_regions["b"]
    reader = AsyncLimiter.from_url(redis_a.url, region="a", rules=[Rule("api", 1_000_000, 10, 1)])
    answers: dict[int, int] = {}
    retry_after: set[str | None] = set()
    body = json.dumps(BODY).encode()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200), timeout=timeout) as flood, \
            aiohttp.ClientSession(timeout=timeout) as probe:
        await eventually(lambda: _ready(probe, url_a), timeout=20, what="a ready")
        end = time.monotonic() + 3.0

        async def client() -> None:
            while time.monotonic() < end:
                async with flood.post(url_a + "/v1/check", data=body,
                                      headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                    answers[resp.status] = answers.get(resp.status, 0) + 1
                    if resp.status == 503:
                        retry_after.add(resp.headers.get("Retry-After"))

        clients = asyncio.gather(*(client() for _ in range(200)))
        delivered: list[float] = []
        try:
            while time.monotonic() < end - 0.5:
                subject = f"probe:{len(delivered)}"
                status, _, decision = await _post(probe, url_b, {"rule": "api", "subject": subject})
                assert status == 200
                assert decision["allowed"]
                delivered.append(await eventually(
                    functools.partial(_counted_from_b, reader, subject), timeout=5.0,
                    what=f"b's hit on {subject} in a's Redis while a is flooded"))
        finally:
            await clients
            await reader.aclose()
        async with probe.get(url_a + "/metrics") as resp:
            shed = _sample(await resp.text(), "geolimit_checks_shed_total")
    assert set(answers) == {200, 503}, answers
    assert retry_after == {"1"}
    assert shed == answers[503], "every 503 is counted"
    assert len(delivered) >= 2


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/readyz") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def _counted_from_b(reader: AsyncLimiter, subject: str) -> bool:
    return (await reader.usage("api", subject)).by_region.get("b", 0) >= 1


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")

"""A peer's freshness with `geolimit agent --workers 2`: real processes, as an operator runs them.

Region a is a supervisor with two workers on one port, region b a single agent, each
with a redis-server of its own. b's deltas reach whichever of a's workers accepted b's
keep-alive connections (often only one), while each worker publishes b's freshness for
the shards it owns; the workers share when b's deltas last reached any of them
(replication/heard.py). A ``closed`` rule decided in a's Redis, on subjects of both
workers' shards, must allow while b is healthy, deny soon after b stops (its counts are
then unknown) and allow again once b is back. The in-process twin, with b's deltas
forced to one worker: tests/replication/test_worker_sharing.py.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from geolimit import AsyncLimiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess
from tests.server.workers_support import all_ready, get, make_regions, start, statuses
from tests.support.regions import eventually

CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed", partition_after=1.0)
API = Rule("api", 100_000, 3600, 360)
TOML_RULES = [
    {"name": "closed", "limit": "1000000/10s", "resolution": "1s", "partition": "closed", "partition_after": "1s"},
    {"name": "api", "limit": "100000/1h", "resolution": "6m"},
]
LAYOUT = KeyLayout()
HEALTHY_FOR = 6.0  # seconds of decisions with b healthy (24 heartbeats of b)


def subjects_of(worker: int, count: int = 6) -> list[str]:
    """Subjects on shards that worker ``worker`` of 2 owns (shard % 2)."""
    found = (s for s in (f"user-{worker}-{i}" for i in range(10_000)) if LAYOUT.shard_of(s.encode()) % 2 == worker)
    return [next(found) for _ in range(count)]


SUBJECTS = subjects_of(0) + subjects_of(1)


@pytest.fixture
async def limiter_a(redis_server_factory: Callable[..., EmbeddedRedis]) -> AsyncIterator[tuple[EmbeddedRedis, AsyncLimiter]]:
    server = redis_server_factory()
    limiter = AsyncLimiter.from_url(server.url, region="a", rules=[CLOSED, API])
    try:
        yield server, limiter
    finally:
        await limiter.aclose()


async def allowed(limiter: AsyncLimiter) -> dict[str, bool]:
    """The closed rule's decision in a for every subject (hits: as an app's traffic)."""
    decisions = await limiter.hit_many([("closed", s, 1) for s in SUBJECTS])
    return {s: d.allowed for s, d in zip(SUBJECTS, decisions, strict=True)}


def metric(text: str, name: str) -> float:
    found = re.search(rf'^{name}\{{peer="b"\}} (\S+)$', text, re.M)
    assert found, (name, text)
    return float(found.group(1))


async def test_a_closed_rule_on_either_workers_shards_allows_while_b_is_healthy_and_denies_once_it_stops(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession, limiter_a: tuple[EmbeddedRedis, AsyncLimiter],
) -> None:
    redis_a, limiter = limiter_a
    # No periodic anti-entropy during the test; the gossip defaults otherwise.
    regions = make_regions(tmp_path, {"a": redis_a, "b": redis_server_factory()}, {}, anti_entropy_interval="600s",
                           rules=TOML_RULES, interval=0.1)
    a, b = regions["a"], regions["b"]
    await start(b, supervisors)
    await start(a, supervisors, "--workers", "2")
    await statuses(http, a, all_ready)
    # A region that just started knows nothing of b's counts until b's first delta arrives
    # (readiness does not wait for it): the closed rule denies until then.
    await eventually(lambda: _all(limiter, True), timeout=10, what="the closed rule allowing once b is heard")

    wrong: list[tuple[float, list[str]]] = []
    began = time.monotonic()
    while time.monotonic() - began < HEALTHY_FOR:
        denied = [s for s, ok in (await allowed(limiter)).items() if not ok]
        if denied:
            wrong.append((round(time.monotonic() - began, 2), denied))
        await asyncio.sleep(0.05)
    assert not wrong, f"denied with b healthy (seconds in, subjects): {wrong[:5]}, {len(wrong)} polls"

    seen = await statuses(http, a, lambda s: len(s) == 2)
    for index, status in seen.items():
        region_b = status["worker"]["region_peers"]["b"]
        assert region_b["last_contact_age"] < 1.0, (index, region_b)
        assert region_b["lag"] < 1.0, (index, region_b)
    text = await get(http, a.url + "/metrics")
    assert metric(text, "geolimit_peer_contact_age_seconds") < 1.0
    assert metric(text, "geolimit_peer_lag_seconds") < 1.0

    assert b.proc is not None
    b.proc.proc.send_signal(signal.SIGTERM)
    assert await b.proc.wait(timeout=20) == 0, b.proc.log
    # partition_after (1 s) after b's last delta, plus a round of a's workers to publish it.
    took = await eventually(lambda: _all(limiter, False), timeout=3.0, what="every subject denied once b stopped",
                            pause=0.02)
    for _ in range(10):  # and it stays so while b is gone
        assert not any((await allowed(limiter)).values())
        await asyncio.sleep(0.05)
    seen = await statuses(http, a, lambda s: len(s) == 2)
    assert all(s["worker"]["region_peers"]["b"]["lag"] > 1.0 for s in seen.values()), seen

    await start(b, supervisors)
    await eventually(lambda: _all(limiter, True), timeout=15, what="every subject allowed once b is back", pause=0.02)
    assert took < 3.0


async def _all(limiter: AsyncLimiter, want: bool) -> bool:
    return all(ok == want for ok in (await allowed(limiter)).values())

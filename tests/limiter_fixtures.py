"""Fixtures that build limiters on the real standalone server and the real cluster."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.cluster

from geolimit import AsyncLimiter, Limiter, Rule

BACKENDS = [pytest.param("standalone", id="standalone"), pytest.param("cluster", id="cluster", marks=pytest.mark.cluster)]


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> str:
    """URL of the standalone server or of the cluster (each test gets a fresh prefix)."""
    name = request.getfixturevalue("redis_url" if request.param == "standalone" else "redis_cluster_url")
    return str(name)


@pytest.fixture
def raw_client(backend_url: str) -> Iterator[redis.Redis | redis.cluster.RedisCluster]:
    """A plain redis-py client on the same backend, for inspecting keys."""
    if backend_url.startswith("redis+cluster://"):
        client: Any = redis.cluster.RedisCluster.from_url(backend_url.replace("redis+cluster://", "redis://"))
    else:
        client = redis.Redis.from_url(backend_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def make_limiter(backend_url: str) -> Iterator[Callable[..., Limiter]]:
    made: list[Limiter] = []
    prefix = "t" + secrets.token_hex(4)

    def make(rules: list[Rule], region: str = "east", **kwargs: Any) -> Limiter:
        kwargs.setdefault("prefix", prefix)
        limiter = Limiter.from_url(backend_url, region=region, rules=rules, **kwargs)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        limiter.close()


@pytest.fixture
async def make_async_limiter(backend_url: str) -> AsyncIterator[Callable[..., AsyncLimiter]]:
    made: list[AsyncLimiter] = []
    prefix = "t" + secrets.token_hex(4)

    def make(rules: list[Rule], region: str = "east", **kwargs: Any) -> AsyncLimiter:
        kwargs.setdefault("prefix", prefix)
        limiter = AsyncLimiter.from_url(backend_url, region=region, rules=rules, **kwargs)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()

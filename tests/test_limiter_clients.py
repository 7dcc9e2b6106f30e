"""The redis-py clients a limiter is handed: the right kind works, the others are refused
at construction with what to pass instead (before, a ``decode_responses=True`` client
failed on the first ``hit`` with a bare TypeError, and a sync client in AsyncLimiter with a
TypeError and "coroutine was never awaited")."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio

from geolimit import AsyncLimiter, ConfigError, Limiter, Rule

RULES = [Rule("api", 3, 10)]


def test_a_client_that_decodes_responses_is_refused_with_the_fix(redis_url: str) -> None:
    with pytest.raises(ConfigError, match="decode_responses=True"):
        Limiter(redis.Redis.from_url(redis_url, decode_responses=True), "us-east", RULES)
    with pytest.raises(ConfigError, match="decode_responses=True"):
        AsyncLimiter(redis.asyncio.Redis.from_url(redis_url, decode_responses=True), "us-east", RULES)


def test_a_client_of_the_other_kind_is_refused(redis_url: str) -> None:
    with pytest.raises(ConfigError, match="AsyncLimiter needs an asyncio client"):
        AsyncLimiter(redis.Redis.from_url(redis_url), "us-east", RULES)
    with pytest.raises(ConfigError, match="Limiter needs a sync client"):
        Limiter(redis.asyncio.Redis.from_url(redis_url), "us-east", RULES)


def test_an_existing_plain_client_is_wrapped(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    limiter = Limiter(client, "us-east", RULES)
    assert [limiter.hit("api", "user:1").allowed for _ in range(4)] == [True, True, True, False]


async def test_an_existing_plain_asyncio_client_is_wrapped(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    await client.flushdb()
    limiter = AsyncLimiter(client, "us-east", RULES)
    try:
        assert [(await limiter.hit("api", "user:1")).allowed for _ in range(4)] == [True, True, True, False]
    finally:
        await limiter.aclose()
        await client.aclose()

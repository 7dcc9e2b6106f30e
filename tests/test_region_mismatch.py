"""Two regions on one Redis (same key prefix) are refused, as a window mismatch is."""

from __future__ import annotations

import secrets

import pytest
import redis

from geolimit import AsyncLimiter, Limiter, Rule
from geolimit.errors import ConfigError

RULES = [Rule("api", limit=10, window=10)]


def test_a_second_region_on_the_same_redis_is_refused(redis_url: str) -> None:
    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="us-east", rules=RULES, prefix=prefix) as east:
        assert east.hit("api", "u").allowed
        with Limiter.from_url(redis_url, region="eu-west", rules=RULES, prefix=prefix) as west, \
                pytest.raises(ConfigError) as info:
            west.hit("api", "u")
    message = str(info.value)
    assert "belongs to region 'us-east'" in message
    assert "names region 'eu-west'" in message
    assert "own Redis" in message


def test_same_region_in_several_processes_and_other_prefixes_are_fine(redis_url: str) -> None:
    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="us-east", rules=RULES, prefix=prefix) as a, \
            Limiter.from_url(redis_url, region="us-east", rules=RULES, prefix=prefix) as b, \
            Limiter.from_url(redis_url, region="eu-west", rules=RULES, prefix=prefix + "x") as other:
        assert a.hit("api", "u").allowed
        assert b.hit("api", "u").remaining == 8
        assert other.hit("api", "u").remaining == 9


async def test_async_limiter_of_another_region_is_refused(redis_url: str) -> None:
    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="ap-south", rules=RULES, prefix=prefix) as south:
        south.hit("api", "u")
    west = AsyncLimiter.from_url(redis_url, region="eu-west", rules=RULES, prefix=prefix)
    try:
        with pytest.raises(ConfigError, match="belongs to region 'ap-south'"):
            await west.hit("api", "u")
    finally:
        await west.aclose()


def test_the_message_says_how_to_release_a_renamed_region(redis_url: str) -> None:
    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="old-name", rules=RULES, prefix=prefix) as old:
        old.hit("api", "u")
    with Limiter.from_url(redis_url, region="new-name", rules=RULES, prefix=prefix) as new:
        with pytest.raises(ConfigError) as info:
            new.hit("api", "u")
        assert f"HDEL {prefix}#rules @region" in str(info.value)
        client = redis.Redis.from_url(redis_url)
        client.hdel(f"{prefix}#rules", "@region")
        client.close()
        assert new.hit("api", "u").allowed

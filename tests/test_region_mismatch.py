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


async def test_an_agent_started_on_another_regions_redis_is_refused_at_start(redis_url: str) -> None:
    """Not only its first decision: an agent would otherwise gossip (with the other
    region's incarnation) and report itself ready while its own region's Redis is
    not replicated at all."""
    from geolimit.server.agent import Agent
    from geolimit.server.config import AgentConfig, PeerConfig

    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="us-east", rules=RULES, prefix=prefix) as east:
        east.hit("api", "u")
    agent = Agent(AgentConfig(region="eu-west", redis_url=redis_url, listen=("127.0.0.1", 0),
                              secret=secrets.token_bytes(32), peers=(PeerConfig("us-east", "http://127.0.0.1:9"),),
                              rules=tuple(RULES), key_prefix=prefix))
    with pytest.raises(ConfigError, match="belongs to region 'us-east', but this process names region 'eu-west'"):
        await agent.listen()
    await agent.abort()


async def test_a_proxy_on_another_regions_redis_is_refused_at_start(redis_url: str) -> None:
    """A library-mode proxy would otherwise fail open on every request and say it is ready."""
    from geolimit.proxy import Proxy, parse_proxy_config
    from tests.proxy.helpers import proxy_config

    prefix = "rm" + secrets.token_hex(4)
    with Limiter.from_url(redis_url, region="us-east", rules=RULES, prefix=prefix) as east:
        east.hit("api", "u")
    data = proxy_config(["http://127.0.0.1:9"], redis_url=redis_url, region="eu-west",
                        rules=[{"name": "api", "limit": "10/10s"}], routes=[{"path": "/*", "limits": [{"rule": "api"}]}],
                        key_prefix=prefix)
    proxy = Proxy(parse_proxy_config(data))
    with pytest.raises(ConfigError, match="belongs to region 'us-east'"):
        await proxy.start()

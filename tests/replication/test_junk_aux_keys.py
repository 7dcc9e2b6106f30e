"""A shard's bookkeeping key of another type (junk) is repaired within a round.

With ``gl:{5}#p`` replaced by a string, every decision on shard 5 with a ``closed``
rule failed (WRONGTYPE) and so did ``drain.lua`` (and the takeover's
``freshen.lua``), for as long as the key stayed. Now the agent's per-round scripts
delete such a key and write it again: the decisions fail until the next round at
most. Real redis-server (``redis_url``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.errors import StorageError
from geolimit.replication.redis_io import ReplicationStore
from geolimit.replication.takeover import FreshnessTakeover
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
CLOSED = Rule("closed", 100, 10, 1, partition="closed")
SUBJECT = b"s7"


@pytest.fixture
async def region_a(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore]]:
    """Region a with peer b on the flushed Redis, b current, one hit on SUBJECT recorded."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="a", rules=[CLOSED], clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "a", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=["b"])
    await store.drain(peer_ages={"b": 0})
    assert (await limiter.hit("closed", SUBJECT)).allowed
    yield limiter, store
    await limiter.aclose()


def _key(limiter: AsyncLimiter, suffix: str) -> bytes:
    return limiter.layout.tag(limiter.layout.shard_of(SUBJECT)) + suffix.encode()


@pytest.mark.parametrize(("suffix", "decisions_fail"),
                         [("#p", True), ("#c", True), ("#r", True), ("#o:b", False), ("#t:b", False)])
async def test_a_key_of_another_type_is_deleted_and_rewritten_by_the_next_drain(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis, suffix: str, decisions_fail: bool
) -> None:
    limiter, store = region_a
    key = _key(limiter, suffix)
    kind = redis_client.type(key)
    redis_client.delete(key)
    if suffix == "#t:b":  # a string: junk of another type is a hash
        redis_client.hset(key, "x", "junk")
    else:
        redis_client.set(key, "junk")
    if decisions_fail:
        with pytest.raises(StorageError, match="WRONGTYPE"):
            await limiter.hit("closed", SUBJECT)
    drained = await store.drain(peer_ages={"b": 0})
    assert drained.failed == {}
    assert drained.junk == 1
    expected = b"string" if suffix == "#t:b" else b"hash"
    assert kind in (expected, b"none")
    assert redis_client.type(key) in (expected, b"none")
    got = await limiter.hit("closed", SUBJECT)  # b is current: the closed rule allows
    assert got.allowed
    drained = await store.drain(peer_ages={"b": 0})
    assert drained.junk == 0
    assert drained.failed == {}
    assert sum(drained.pending["b"].values()) == 1  # the subject's key waits in b's outbox
    assert redis_client.hget(_key(limiter, "#p"), "#R") == b"2"


async def test_a_junk_peers_hash_does_not_stop_the_other_shards_nor_the_next_rounds(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region_a
    redis_client.delete(_key(limiter, "#p"))
    redis_client.set(_key(limiter, "#p"), "junk")
    assert (await store.drain(peer_ages={"b": 0})).junk == 1
    for _ in range(2):
        assert (await store.drain(peer_ages={"b": 0})).junk == 0
    assert redis_client.hkeys(_key(limiter, "#p")) != []


async def test_the_takeover_rewrites_a_junk_peers_hash_too(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    """``freshen.lua`` publishes for a worker that is down: with its shard's peers hash junk,
    it failed at every round (and the decisions there) until that worker was back."""
    limiter, store = region_a
    key = _key(limiter, "#p")
    redis_client.delete(key)
    redis_client.set(key, "junk")
    takeover = FreshnessTakeover(limiter.store, limiter.layout, 0, 2)
    shard = limiter.layout.shard_of(SUBJECT)
    assert await takeover.publish([shard], {"b": 0}, 0, store.clock_arg()) == 1
    assert redis_client.type(key) == b"hash"
    assert redis_client.hget(key, "#R") == b"2"
    assert redis_client.hget(key, "b") is not None
    assert (await limiter.hit("closed", SUBJECT)).allowed
    assert await takeover.publish([shard], {"b": 1_000_000}, 0, store.clock_arg()) == 0  # only forward


async def test_an_agent_repairs_a_junk_key_in_a_round_and_counts_it(redis_server_factory: Factory) -> None:
    """Through a real agent: the closed rule's decisions on the junk shard fail, one round later
    they are decided again, and ``/metrics`` counts the repair (geolimit_junk_keys_repaired)."""
    async with Regions(redis_server_factory, ["a", "b"], [CLOSED], run_loops=False) as rs:
        await rs.step(5)
        a = rs["a"].app()
        assert a.hit("closed", SUBJECT).allowed
        key = a.layout.tag(a.layout.shard_of(SUBJECT)) + b"#p"
        client = rs["a"].client()
        client.delete(key)
        client.set(key, "junk")
        with pytest.raises(StorageError):
            a.hit("closed", SUBJECT)
        await rs.step(1)
        assert a.hit("closed", SUBJECT).allowed
        async with aiohttp.ClientSession() as http, http.get(rs["a"].agent.url + "/metrics") as resp:
            text = await resp.text()
        assert re.search(r"^geolimit_junk_keys_repaired_total 1\.0$", text, re.MULTILINE), text[:2000]


async def test_an_outbox_whose_junk_time_was_deleted_gets_a_time(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    """A junk ``#t:b`` (the time the oldest entry of b's outbox was queued) next to an empty
    outbox: the first run moved the changes into the outbox, failed at the time, and the rerun
    found nothing to queue, so the outbox was left without a time and b's lag read 0."""
    limiter, store = region_a
    key = _key(limiter, "#t:b")
    redis_client.delete(key)
    redis_client.hset(key, "x", "junk")
    drained = await store.drain(peer_ages={"b": 0})
    assert drained.junk == 1
    assert redis_client.hlen(_key(limiter, "#o:b")) == 1
    assert redis_client.type(key) == b"string"
    assert drained.oldest_us.get("b") is not None

"""Durable outboxes in Redis: what drain, pack and settle promise (real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication.redis_io import ReplicationStore

API = Rule("api", 1000, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)


@pytest.fixture
async def limiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[AsyncLimiter]:
    lim = AsyncLimiter.from_url(redis_url, region="a", rules=[API], clock=CLOCK)
    yield lim
    await lim.aclose()


def _store(lim: AsyncLimiter, peers: list[str]) -> ReplicationStore:
    return ReplicationStore(lim.store, lim.layout, "a", lim.rules, b"n0", now_us=CLOCK.now_us, peers=peers)


async def test_a_peer_removed_from_the_config_disappears_with_its_outbox(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    old = _store(limiter, ["b", "ghost"])
    await old.drain(peer_ages={"b": 0, "ghost": 0})
    await limiter.hit("api", "u")
    drained = await old.drain(peer_ages={"b": 0, "ghost": 0})
    assert sum(drained.pending["ghost"].values()) == 1
    shard = limiter.layout.shard_of(b"u")
    peers_key = limiter.layout.peers_key(shard)
    assert redis_client.hget(peers_key, "ghost") is not None
    await _store(limiter, ["b"]).drain(peer_ages={"b": 0})  # the agent restarts without "ghost"
    assert redis_client.hget(peers_key, "ghost") is None  # no longer reserved for, nor closing a rule
    assert redis_client.hget(peers_key, "#R") == b"2"
    assert redis_client.keys(b"gl:{*}#o:ghost") == []
    assert redis_client.keys(b"gl:{*}#o:b") != []  # b's outbox is untouched


async def test_an_ack_removes_what_was_sent_and_nothing_written_since(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b"])
    await store.drain()
    await limiter.hit("api", "u")
    drained = await store.drain()
    packed = await store.pack("b", 0, sorted(drained.pending["b"]))
    assert packed.keys == 1
    await limiter.hit("api", "u")  # written while the batch is in flight
    await store.drain()
    await store.settle("b", 0, packed.shards, delivered=True)
    again = await store.drain()
    assert sum(again.pending["b"].values()) == 1  # the later hit still waits for b


async def test_a_failed_batch_and_a_crashed_agent_lose_nothing(limiter: AsyncLimiter) -> None:
    store = _store(limiter, ["b"])
    await store.drain()
    for subject in ("u", "v", "w"):
        await limiter.hit("api", subject)
    drained = await store.drain()
    packed = await store.pack("b", 1, sorted(drained.pending["b"]))
    assert packed.keys == 3
    assert sum((await store.drain()).pending["b"].values()) == 0  # all in flight
    await _store(limiter, ["b"]).recover()  # a new agent process returns what the old one left in flight
    assert sum((await store.drain()).pending["b"].values()) == 3

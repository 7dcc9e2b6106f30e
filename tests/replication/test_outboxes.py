"""Durable outboxes in Redis: what drain, pack and settle promise.

Every test runs on the standalone server and on the 3-master cluster (``backend_url``,
tests/limiter_fixtures.py): on the cluster, the scripts of the 64 shards' calls go to
all three masters.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.cluster

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.keys import glob_escape
from geolimit.replication.redis_io import ReplicationStore

API = Rule("api", 1000, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)
AnyRedis = redis.Redis | redis.cluster.RedisCluster


@pytest.fixture
def limiter(make_async_limiter: Callable[..., AsyncLimiter]) -> AsyncLimiter:
    """Region "a"'s limiter on the backend, under a fresh key prefix."""
    return make_async_limiter([API], region="a", clock=CLOCK)


def outbox_keys(client: AnyRedis, lim: AsyncLimiter, peer: str) -> list[bytes]:
    pattern = glob_escape(lim.layout.prefix.encode()) + b":{*}#o:" + glob_escape(peer.encode())
    return list(client.scan_iter(match=pattern, count=1000))


def _store(lim: AsyncLimiter, peers: list[str]) -> ReplicationStore:
    return ReplicationStore(lim.store, lim.layout, "a", lim.rules, b"n0", now_us=CLOCK.now_us, peers=peers)


async def test_a_peer_removed_from_the_config_disappears_with_its_outbox(
    limiter: AsyncLimiter, raw_client: AnyRedis
) -> None:
    old = _store(limiter, ["b", "ghost"])
    await old.drain(peer_ages={"b": 0, "ghost": 0})
    await limiter.hit("api", "u")
    drained = await old.drain(peer_ages={"b": 0, "ghost": 0})
    assert sum(drained.pending["ghost"].values()) == 1
    shard = limiter.layout.shard_of(b"u")
    _, _, peers_key = limiter.layout.aux_keys(shard)
    assert raw_client.hget(peers_key, "ghost") is not None
    assert outbox_keys(raw_client, limiter, "ghost") != []
    await _store(limiter, ["b"]).drain(peer_ages={"b": 0})  # the agent restarts without "ghost"
    assert raw_client.hget(peers_key, "ghost") is None  # not reserved for, nor closing a rule
    assert raw_client.hget(peers_key, "#R") == b"2"
    assert outbox_keys(raw_client, limiter, "ghost") == []
    assert outbox_keys(raw_client, limiter, "b") != []  # b's outbox is untouched


async def test_an_ack_removes_what_was_sent_and_nothing_written_since(limiter: AsyncLimiter) -> None:
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


async def test_a_returned_batch_keeps_its_age_in_the_lag(limiter: AsyncLimiter) -> None:
    store = _store(limiter, ["b"])
    await store.drain()
    await limiter.hit("api", "u")
    queued = CLOCK.now_us()
    drained = await store.drain()
    assert drained.oldest_us["b"] == queued
    packed = await store.pack("b", 0, sorted(drained.pending["b"]))
    CLOCK.advance(30)  # the send fails after 30 s
    await store.settle("b", 0, packed.shards, delivered=False)
    again = await store.drain()
    assert sum(again.pending["b"].values()) == 1
    assert again.oldest_us["b"] == queued, "the lag counts from the first queueing, not from the retry"


async def test_an_unreachable_peers_outbox_drops_keys_that_expired(limiter: AsyncLimiter, raw_client: AnyRedis) -> None:
    store = _store(limiter, ["b"])
    await store.drain()
    subjects = [f"u{i}" for i in range(200)]
    for subject in subjects:
        await limiter.hit("api", subject)
    drained = await store.drain()
    assert sum(drained.pending["b"].values()) == 200
    for subject in subjects[:150]:  # as if they expired while b was cut off
        raw_client.delete(limiter.layout.data_key("api", subject.encode()))
    cursors: dict[int, bytes] = {}
    dropped = await store.prune("b", cursors, store.owned, count=10)
    while any(c != b"0" for c in cursors.values()):
        dropped += await store.prune("b", cursors, [s for s, c in cursors.items() if c != b"0"], count=10)
    assert dropped == 150
    left = await store.drain()
    assert sum(left.pending["b"].values()) == 50, "live keys stay queued"
    packed = await store.pack("b", 0, sorted(left.pending["b"]))
    assert packed.keys == 50

"""The fast paths of drain.lua, pack.lua and settle.lua keep every entry (real Redis).

One shard, so that every key shares one changed hash and one outbox per peer:

* drain: a changed hash that fits (or, with one peer, any changed hash) moves by
  COPY / RENAME into empty outboxes and merges into non-empty ones; a larger one
  is taken in bounded HSCAN batches, from a cursor that moves with the clock;
* pack: an in-flight slot holds one field per pack call ('#<n>' -> msgpack of
  the keys and entries it took); a nack returns them all to the outbox, and so
  it does for in-flight fields of one key each (key -> entry), which settle.lua still reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgpack
import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication.redis_io import Limits, ReplicationStore
from tests.support.blobs import unblob

API = Rule("api", 1000, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)


@pytest.fixture
async def limiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[AsyncLimiter]:
    CLOCK.set(1_700_000_000.0)
    lim = AsyncLimiter.from_url(redis_url, region="a", rules=[API], shards=1, clock=CLOCK)
    yield lim
    await lim.aclose()


def _store(lim: AsyncLimiter, peers: list[str], limits: Limits | None = None) -> ReplicationStore:
    return ReplicationStore(lim.store, lim.layout, "a", lim.rules, b"n0", now_us=CLOCK.now_us, peers=peers,
                            limits=limits)


async def _hit(lim: AsyncLimiter, subjects: range) -> None:
    await lim.hit_many([("api", f"s{i}", 1) for i in subjects])


def _hash(client: redis.Redis, key: bytes) -> dict[bytes, bytes]:
    return dict(client.hgetall(key))  # type: ignore[arg-type]


async def test_a_changed_hash_that_fits_is_copied_and_merged_into_the_outboxes(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b", "c"], Limits(drain_keys=100))
    await store.drain()
    await _hit(limiter, range(10))
    tag = limiter.layout.tag(0)
    changed = _hash(redis_client, tag + b"#c")
    redis_client.hset(tag + b"#o:c", mapping={b"gl:{0}:api:s0": b"-1", b"gl:{0}:api:old": b"7"})  # c is behind
    drained = await store.drain()
    assert (drained.taken, drained.changed_left) == (10, 0)
    assert not redis_client.exists(tag + b"#c")
    assert _hash(redis_client, tag + b"#o:b") == changed  # copied as it was
    into_c = _hash(redis_client, tag + b"#o:c")
    assert into_c == {**changed, b"gl:{0}:api:s0": b"-1", b"gl:{0}:api:old": b"7"}  # the wider entry stays
    assert drained.pending == {"b": {0: 10}, "c": {0: 11}}
    assert drained.oldest_us["b"] is not None


async def test_with_one_peer_any_changed_hash_moves_in_one_call(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b"], Limits(drain_keys=10))
    await store.drain()
    await _hit(limiter, range(300))
    changed = _hash(redis_client, limiter.layout.tag(0) + b"#c")
    drained = await store.drain()
    assert (drained.taken, drained.changed_left) == (300, 0)  # one RENAME: O(1) whatever the size
    assert _hash(redis_client, limiter.layout.tag(0) + b"#o:b") == changed


async def test_a_larger_changed_hash_is_taken_in_bounded_batches_without_loss(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b", "c"], Limits(drain_keys=64))
    await store.drain()
    await _hit(limiter, range(1000))  # a hashtable, not a small listpack: HSCAN walks it
    changed = _hash(redis_client, limiter.layout.tag(0) + b"#c")
    calls = 0
    while True:
        drained = await store.drain()
        calls += 1
        assert drained.taken <= 64
        if not drained.changed_left:
            break
        CLOCK.advance(0.000_7)  # the next scan starts elsewhere
    assert calls >= 1000 // 64
    for peer in ("b", "c"):
        assert _hash(redis_client, limiter.layout.tag(0) + b"#o:" + peer.encode()) == changed


async def test_pack_keeps_one_field_per_call_in_flight_and_a_nack_returns_every_entry(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b"], Limits(pack_keys=40, pack_cells=1000))
    await store.drain()
    await _hit(limiter, range(100))
    await store.drain()
    tag = limiter.layout.tag(0)
    queued = _hash(redis_client, tag + b"#o:b")
    sent: list[bytes] = []
    for _ in range(3):
        packed = await store.pack("b", 2, [0])
        sent += [b"gl:{0}:api:" + subject for _, subject, *_ in unblob(packed.blobs)]
    assert sorted(sent) == sorted(queued)  # 40 + 40 + 20, each key once
    assert not redis_client.exists(tag + b"#o:b")
    flight = _hash(redis_client, tag + b"#f:b:2")
    assert flight.pop(b"@t") == b"%d" % CLOCK.now_us()  # when the batch's oldest entry was queued
    assert sorted(flight) == [b"#1", b"#2", b"#3"]
    entries = [msgpack.unpackb(v, raw=True) for v in flight.values()]
    assert dict(pair for flat in entries for pair in zip(flat[::2], flat[1::2], strict=True)) == queued
    await limiter.hit("api", "s5")  # written while in flight
    await store.drain()
    await store.settle("b", 2, [0], delivered=False)
    assert _hash(redis_client, tag + b"#o:b") == queued  # s5's newer entry merges to the older bucket
    assert not redis_client.exists(tag + b"#f:b:2")


async def test_a_nack_returns_in_flight_entries_stored_one_key_a_field(
    limiter: AsyncLimiter, redis_client: redis.Redis
) -> None:
    store = _store(limiter, ["b"])
    await store.drain()
    tag = limiter.layout.tag(0)
    redis_client.hset(tag + b"#f:b:1", mapping={b"gl:{0}:api:u": b"5", b"gl:{0}:api:v": b"-3"})
    redis_client.hset(tag + b"#o:b", mapping={b"gl:{0}:api:u": b"4"})
    await store.settle("b", 1, [0], delivered=False)
    assert _hash(redis_client, tag + b"#o:b") == {b"gl:{0}:api:u": b"4", b"gl:{0}:api:v": b"-3"}
    assert not redis_client.exists(tag + b"#f:b:1")

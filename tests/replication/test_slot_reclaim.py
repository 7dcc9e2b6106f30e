"""Slot ids of long-idle incarnations are taken back, and their indices reused safely.

Each wipe of a region's Redis starts a new incarnation: one more slot id in every
peer's registry of each shard. ``reclaim.lua`` takes back the index of a slot that
has written nothing in the shard for ``ReplicationStore.reclaim_idle_us()`` (twice
the longest key TTL, the parking span and a minute); ``merge.lua`` hands freed
indices to new slot ids before it grows the registry. Real Redis, a manual clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.window import SUBSTEPS
from geolimit.errors import ProtocolError
from geolimit.replication.redis_io import Limits, ReplicationStore, blobs_from_cells
from tests.support.regions import dump_all

API = Rule("api", 1000, 10, 1)


@pytest.fixture
async def region(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore, ManualClock]]:
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[API], clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=["p"], limits=Limits(max_slots=4))
    yield limiter, store, clock
    await limiter.aclose()


async def _merge(store: ReplicationStore, clock: ManualClock, slot: str, subject: bytes, count: int) -> None:
    bucket = clock.now_us() // API.resolution_us
    cells = [("api", subject, bucket, slot, count * SUBSTEPS, 0)]
    await store.merge_blobs(blobs_from_cells(store.layout, cells), "p")


async def test_idle_incarnations_make_room_and_their_indices_count_nothing_old(
    region: tuple[AsyncLimiter, ReplicationStore, ManualClock], redis_client: redis.Redis,
) -> None:
    limiter, store, clock = region
    subject = b"victim"
    shard = store.layout.shard_of(subject)
    await limiter.hit("api", subject)  # this region's own slot: index 0
    for k in range(3):  # p's incarnations 1..3 fill the registry (cap 4)
        await _merge(store, clock, f"p/{k}", subject, 2)
        clock.advance(1.0)
    with pytest.raises(ProtocolError, match="registry is full"):
        await _merge(store, clock, "p/new", subject, 5)
    assert await store.reclaim([shard]) == 0, "nothing is idle yet"
    clock.advance(store.reclaim_idle_us() / 1e6 - 1.5)  # p/0 and p/1 idle past the limit, p/2 not
    assert await store.reclaim([shard]) == 2
    registry = redis_client.hgetall(store.layout.registry_key(shard))
    assert b"p/0" not in registry
    assert b"p/1" not in registry
    assert b"p/2" in registry
    assert registry[b"r/" + registry[b"@"]] == b"0", "the own slot stays"
    # The freed indices go to new slot ids; the old incarnations' cells left the window
    # long ago and count nothing under them.
    await _merge(store, clock, "p/new", subject, 5)
    await _merge(store, clock, "p/newer", subject, 7)
    registry = redis_client.hgetall(store.layout.registry_key(shard))
    assert {registry[b"p/new"], registry[b"p/newer"]} == {b"1", b"2"}
    assert int(registry[b"#"]) == 4, "the registry did not grow"
    usage = await limiter.usage("api", subject)
    assert usage.by_slot == {"p/new": 5, "p/newer": 7}
    assert usage.total == 12


async def test_a_slot_that_keeps_writing_is_never_reclaimed(
    region: tuple[AsyncLimiter, ReplicationStore, ManualClock], redis_client: redis.Redis,
) -> None:
    limiter, store, clock = region
    shard = store.layout.shard_of(b"s")
    idle = store.reclaim_idle_us() / 1e6
    for _ in range(4):
        await _merge(store, clock, "p/live", b"s", 1)
        await limiter.hit("api", b"s")
        clock.advance(idle * 0.6)
        assert await store.reclaim([shard]) == 0
    # A registry written before stamps existed: its slots are stamped at the first look.
    registry_key = store.layout.registry_key(shard)
    redis_client.hset(registry_key, "p/legacy", "3")
    assert await store.reclaim([shard]) == 0
    assert redis_client.hexists(registry_key, "t3")
    clock.advance(idle + 1)
    assert await store.reclaim([shard]) == 2  # p/live (idle now) and p/legacy; never r's own
    assert redis_client.hget(registry_key, "F") in (b"1 3", b"3 1")


async def test_a_repair_may_bring_more_new_slot_ids_than_a_delta(
    region: tuple[AsyncLimiter, ReplicationStore, ManualClock], redis_client: redis.Redis,
) -> None:
    """A region wiped 20 times within a window has 20 incarnations with live cells; the
    anti-entropy that repairs it brings them in one blob. A delta may add at most 16 new
    slot ids per blob, a repair is bounded only by the registry's cap."""
    limiter, store, clock = region
    store.limits = Limits(max_slots=64)
    bucket = clock.now_us() // API.resolution_us
    cells = [("api", b"s", bucket, f"p/{k}", SUBSTEPS, 0) for k in range(20)]
    before = redis_client.dump(limiter.layout.data_key("api", b"s"))
    with pytest.raises(ProtocolError, match="too many new slot ids"):
        await store.merge_blobs(blobs_from_cells(store.layout, cells), "p")
    assert redis_client.dump(limiter.layout.data_key("api", b"s")) == before
    await store.merge_blobs(blobs_from_cells(store.layout, cells), "p", repair=True)
    assert (await limiter.usage("api", b"s")).total == 20


async def test_blobs_that_each_fit_but_not_together_are_refused_whole(
    region: tuple[AsyncLimiter, ReplicationStore, ManualClock], redis_client: redis.Redis,
) -> None:
    """The registry and the new-id cap count the slot ids of all of a message's blobs
    for one shard: 3 blobs of 2 new ids each do not pass a registry with room for 3 by
    being checked one at a time, and nothing of them is written (not even of the first)."""
    limiter, store, clock = region
    await limiter.hit("api", b"victim")  # the own slot: index 0 of 4
    shard = store.layout.shard_of(b"victim")
    bucket = clock.now_us() // API.resolution_us
    blobs = [blob for k in range(2) for blob in blobs_from_cells(
        store.layout, [("api", b"victim", bucket, f"p/{2 * k + j}", SUBSTEPS, 0) for j in range(2)])]
    assert {s for s, _ in blobs} == {shard}
    assert len(blobs) == 2
    before = dump_all(redis_client)
    with pytest.raises(ProtocolError, match="registry is full"):
        await store.merge_blobs(blobs, "p")
    assert dump_all(redis_client) == before
    store.limits = Limits(max_slots=64, new_slots=3)
    with pytest.raises(ProtocolError, match="too many new slot ids"):  # 4 new ids in one message
        await store.merge_blobs(blobs, "p")
    assert dump_all(redis_client) == before
    store.limits = Limits(max_slots=3)
    with pytest.raises(ProtocolError, match="too many slot ids in one message"):
        await store.merge_blobs(blobs, "p")
    assert dump_all(redis_client) == before
    await store.merge_blobs(blobs[:1], "p")
    assert (await limiter.usage("api", b"victim")).total == 3

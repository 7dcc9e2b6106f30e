"""A peer's big message is merged in short trips, at most two at a time, so decisions
do not queue behind it; and a message of many small blobs goes in a few full trips.

Redis runs a pipelined batch of scripts whole: before, a message's blobs went 8 to a
trip, and three signed 1.3 MB messages at once held a region's Redis for about 200 ms
at a stretch (``/v1/check`` p50 201 ms, p99 up to 977 ms). Now a trip carries at most
``MERGE_TRIP_CELLS`` cells (or one blob), and at most ``MERGE_TRIPS_IN_FLIGHT`` trips
of merge calls per agent process are in Redis at any time, whatever the number of
messages being merged. Nothing is lost on the way: every cell of every message is
merged. One trip at a time was too few (bench/soak.py fell behind, its lag growing by
about 1 s every second), and so were trips sized by a message's biggest blob.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication import redis_io
from geolimit.replication.redis_io import (
    MERGE_CALL_CELLS,
    MERGE_TRIP_CELLS,
    MERGE_TRIPS_IN_FLIGHT,
    ReplicationStore,
    blobs_from_cells,
    merge_trips,
)

RULE = Rule("api", 10**6, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)


@pytest.fixture
async def limiter_and_store(redis_url: str) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore]]:
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], prefix="trips", clock=CLOCK)
    store = ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                             peers=["p1", "p2", "p3"])
    yield limiter, store
    await limiter.aclose()


async def test_three_big_messages_are_merged_a_few_short_trips_at_a_time_and_completely(
    limiter_and_store: tuple[AsyncLimiter, ReplicationStore], monkeypatch: pytest.MonkeyPatch,
) -> None:
    limiter, store = limiter_and_store
    bucket = CLOCK.now_us() // RULE.resolution_us
    in_redis, most_at_once, trips = 0, 0, []
    run_many = store.store.run_many

    async def watched(script: Any, calls: list[list[bytes]], per_trip: int | None = None) -> list[Any]:
        nonlocal in_redis, most_at_once
        if script is not redis_io._MERGE:
            return await run_many(script, calls, per_trip)
        in_redis += 1
        most_at_once = max(most_at_once, in_redis)
        trips.append(sum(sum(msgpack.unpackb(call[-1])[2]) for call in calls))  # cells (blob: the last argument)
        try:
            return await run_many(script, calls, per_trip)
        finally:
            in_redis -= 1

    monkeypatch.setattr(store.store, "run_many", watched)
    peers = ["p1", "p2", "p3"]
    messages = []
    for n, peer in enumerate(peers):  # 3 peers x 6,000 subjects
        cells = [("api", b"s%d" % i, bucket, f"{peer}/x", 64 * (n + 1), 0) for i in range(6000)]
        messages.append((peer, blobs_from_cells(store.layout, cells, max_cells=2048)))
    assert all(len(blobs) > 2 for _, blobs in messages)
    await asyncio.gather(*(store.merge_blobs(blobs, peer, relay_to=[]) for peer, blobs in messages))

    assert most_at_once <= MERGE_TRIPS_IN_FLIGHT, f"{most_at_once} trips of merge calls were in Redis at once"
    assert most_at_once == MERGE_TRIPS_IN_FLIGHT, "the messages' trips never overlapped"
    assert sum(trips) == 18_000
    assert max(trips) <= MERGE_TRIP_CELLS, trips
    for subject in (b"s0", b"s2999", b"s5999"):
        usage = await limiter.usage("api", subject)
        assert usage.by_region == {"p1": 1, "p2": 2, "p3": 3}, (subject, usage)


async def test_a_blob_larger_than_a_trip_goes_alone(limiter_and_store: tuple[AsyncLimiter, ReplicationStore],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    limiter, store = limiter_and_store
    monkeypatch.setattr(redis_io, "MERGE_TRIP_CELLS", 100)
    bucket = CLOCK.now_us() // RULE.resolution_us
    cells = [("api", b"t%d" % i, bucket, "p1/x", 64, 0) for i in range(3000)]
    blobs = blobs_from_cells(store.layout, cells, max_cells=1000)
    merged = await store.merge_blobs(blobs, "p1", relay_to=[])
    assert merged.cells == 3000
    assert (await limiter.usage("api", b"t2999")).by_region == {"p1": 1}


async def test_a_message_of_small_blobs_and_one_big_goes_in_a_few_full_trips(
    limiter_and_store: tuple[AsyncLimiter, ReplicationStore], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a loaded link sends: every shard touched, one of them a lot. Trips sized by the
    # biggest blob took this in 64 trips (2 calls each), one at a time, and fell behind.
    limiter, store = limiter_and_store
    bucket = CLOCK.now_us() // RULE.resolution_us
    want = {shard: 10 for shard in range(store.layout.shards)}
    want[0] = 2000
    cells, n = [], 0
    while any(want.values()):
        subject = b"m%d" % n
        n += 1
        shard = store.layout.shard_of(subject)
        if want[shard]:
            want[shard] -= 1
            cells.append(("api", subject, bucket, "p1/x", 64, 0))
    blobs = blobs_from_cells(store.layout, cells)
    assert len(blobs) == store.layout.shards
    trips = 0
    run_many = store.store.run_many

    async def counted(script: Any, calls: list[list[bytes]], per_trip: int | None = None) -> list[Any]:
        nonlocal trips
        trips += script is redis_io._MERGE
        return await run_many(script, calls, per_trip)

    monkeypatch.setattr(store.store, "run_many", counted)
    merged = await store.merge_blobs(blobs, "p1", relay_to=[])
    assert merged.cells == len(cells)
    assert trips <= 3, f"{len(blobs)} blobs took {trips} trips"
    for subject in [c[1] for c in cells[:: len(cells) // 7]]:
        assert (await limiter.usage("api", subject)).by_region == {"p1": 1}


def test_trips_are_filled_by_their_own_cells() -> None:
    assert merge_trips([]) == []
    assert merge_trips([2000] + [10] * 63) == [(0, 64)]
    full = MERGE_TRIP_CELLS - MERGE_CALL_CELLS
    assert merge_trips([full, 1, full + 1, 5]) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # a bigger call goes alone
    small = merge_trips([0] * 1000)  # slot-id checks: the per-call cost bounds a trip
    assert all(end - start <= MERGE_TRIP_CELLS // MERGE_CALL_CELLS for start, end in small)
    assert [i for trip in small for i in range(*trip)] == list(range(1000))

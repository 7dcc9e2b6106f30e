"""A peer's big message is merged in short trips, one at a time, so decisions do not
queue behind it.

Redis runs a pipelined batch of scripts whole: before, a message's blobs went 8 to a
trip, and three signed 1.3 MB messages at once held a region's Redis for about 200 ms
at a stretch (``/v1/check`` p50 201 ms, p99 up to 977 ms). Now a trip carries at most
``MERGE_TRIP_CELLS`` cells (or one blob), and only one trip of merge calls per
agent process is in Redis at any time, whatever the number of messages being merged.
Nothing is lost on the way: every cell of every message is merged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication import redis_io
from geolimit.replication.redis_io import MERGE_TRIP_CELLS, ReplicationStore, blobs_from_cells

RULE = Rule("api", 10**6, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)


@pytest.fixture
async def limiter_and_store(redis_url: str) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore]]:
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], prefix="trips", clock=CLOCK)
    store = ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                             peers=["p1", "p2", "p3"])
    yield limiter, store
    await limiter.aclose()


async def test_three_big_messages_are_merged_one_short_trip_at_a_time_and_completely(
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

    assert most_at_once == 1, "two trips of merge calls were in Redis at once"
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

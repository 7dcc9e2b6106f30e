"""merge_blobs(repair=True): anti-entropy can finish after this region's Redis lost its latest writes.

A delta that claims more in the receiver's own current slot than the receiver
counted is refused whole (nothing written). After a failover to a replica that
missed the last writes, or a restore from a snapshot, the incarnation is the
same but peers legitimately hold more for it: in repair mode those cells are
skipped (never written, counted in ``own_ahead``) and everything else merges.
Real Redis; the failover is a DUMP / RESTORE of the key to an earlier state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.window import SUBSTEPS, count_of
from geolimit.errors import ProtocolError
from geolimit.replication.redis_io import MergeResult, ReplicationStore, blobs_from_cells
from geolimit.replication.wire import Cell6
from tests.support.regions import dump_all

API = Rule("api", 1000, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)
BUCKET = CLOCK.now_us() // API.resolution_us


@pytest.fixture
async def region(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore]]:
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[API], clock=CLOCK)
    store = ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                             peers=["p1", "p2"])
    yield limiter, store
    await limiter.aclose()


def _own_slot(limiter: AsyncLimiter, client: redis.Redis, subject: bytes) -> str:
    """This region's current slot id in the shard of ``subject`` (its registry must exist)."""
    registry = limiter.layout.registry_key(limiter.layout.shard_of(subject))
    incarnation = client.hget(registry, "@")
    assert isinstance(incarnation, bytes), "no registry yet in this shard"
    return "r/" + incarnation.decode()


async def _lose_last_hits(limiter: AsyncLimiter, client: redis.Redis, subject: bytes) -> list[Cell6]:
    """3 hits, then 2 more that a peer received but this Redis loses (restored to after hit 3).

    Returns what the peer holds: this region's cells with all 5 hits, and its own (p1) cell."""
    key = limiter.layout.data_key("api", subject)
    for _ in range(3):
        await limiter.hit("api", subject)
    snapshot = client.dump(key)
    assert snapshot is not None
    for _ in range(2):
        await limiter.hit("api", subject)
    own = _own_slot(limiter, client, subject)
    fields = client.hgetall(key)
    ahead = [("api", subject, BUCKET, own, int(v), 0) for f, v in fields.items() if f not in (b"h", b"e")]
    assert len(ahead) == 1
    assert count_of(ahead[0][4]) == 5
    client.restore(key, 0, snapshot, replace=True)  # the failover: the last 2 hits are gone here
    client.pexpire(key, API.ttl_ms)
    return [*ahead, ("api", subject, BUCKET, "p1/a", 7 * SUBSTEPS, 0)]


async def test_a_delta_claiming_more_in_the_own_slot_is_refused_and_writes_nothing(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region
    peer_copy = await _lose_last_hits(limiter, redis_client, b"u")
    before = dump_all(redis_client)
    with pytest.raises(ProtocolError, match="receiver's own slot"):
        await store.merge_blobs(blobs_from_cells(limiter.layout, peer_copy), "p1")
    assert dump_all(redis_client) == before
    assert (await limiter.usage("api", "u")).total == 3


async def test_repair_skips_the_own_slot_claims_and_merges_the_rest(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region
    peer_copy = await _lose_last_hits(limiter, redis_client, b"u")
    other = [("api", b"v", BUCKET, "p2/b", 4 * SUBSTEPS, 0)]  # another key, in the same or another blob
    result = await store.merge_blobs(blobs_from_cells(limiter.layout, peer_copy + other), "p1", repair=True)
    assert result.own_ahead == 1
    assert result.increased == 2  # p1's cell of u and p2's cell of v; nothing of the own slot
    usage = await limiter.usage("api", "u")
    assert usage.by_region == {"r": 3, "p1": 7}  # the own slot keeps what this Redis counted
    assert (await limiter.usage("api", "v")).by_region == {"p2": 4}
    again = await store.merge_blobs(blobs_from_cells(limiter.layout, peer_copy), "p1", repair=True)
    assert (again.own_ahead, again.increased) == (1, 0)  # idempotent: skipped again, nothing rose


async def test_repair_skips_a_floor_above_the_own_count_and_a_claim_on_a_key_it_lacks(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region
    await store.drain()  # every shard gets its registry (and this region's slot)
    await limiter.hit("api", "u")
    cells: list[Cell6] = [
        ("api", b"u", BUCKET, _own_slot(limiter, redis_client, b"u"), SUBSTEPS, 5 * SUBSTEPS),  # value echoed, floor above it
        ("api", b"lost", BUCKET, _own_slot(limiter, redis_client, b"lost"), 2 * SUBSTEPS, 0),  # a key this Redis lacks
        ("api", b"u", BUCKET, "p1/a", 3 * SUBSTEPS, 0),
    ]
    before = dump_all(redis_client)
    with pytest.raises(ProtocolError):
        await store.merge_blobs(blobs_from_cells(limiter.layout, cells), "p1")
    assert dump_all(redis_client) == before
    result = await store.merge_blobs(blobs_from_cells(limiter.layout, cells), "p1", repair=True)
    assert result.own_ahead == 2
    assert (await limiter.usage("api", "u")).by_region == {"r": 1, "p1": 3}
    assert not redis_client.exists(limiter.layout.data_key("api", b"lost"))


async def test_an_echo_of_the_own_slot_is_accepted_in_both_modes(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region
    for _ in range(4):
        await limiter.hit("api", "u")
    own = _own_slot(limiter, redis_client, b"u")
    key = limiter.layout.data_key("api", b"u")
    value = next(int(v) for f, v in redis_client.hgetall(key).items() if f not in (b"h", b"e"))
    echo: list[Cell6] = [("api", b"u", BUCKET, own, value, 0), ("api", b"u", BUCKET, own, value - SUBSTEPS, 0)]
    for repair in (False, True):
        result = await store.merge_blobs(blobs_from_cells(limiter.layout, echo), "p1", repair=repair)
        assert (result.own_ahead, result.increased) == (0, 0)
    assert (await limiter.usage("api", "u")).total == 4


async def test_repair_still_refuses_what_no_peer_may_send(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    limiter, store = region
    await limiter.hit("api", "u")
    before = dump_all(redis_client)
    for bad in ([("api", b"u", BUCKET, "p1/a", 2**62, 0)], [("api", b"u", BUCKET, "mallory/1", SUBSTEPS, 0)]):
        with pytest.raises(ProtocolError):
            await store.merge_blobs(blobs_from_cells(limiter.layout, bad), "p1", repair=True)
    assert dump_all(redis_client) == before


def test_merge_result_reads_replies_of_any_length() -> None:
    result = MergeResult()
    result.add([1, 10, 2, 1, 0, 3, 4])  # a reply without own_ahead (an older merge.lua)
    result.add([1, 5, 1, 0, 1, 0, 0, 2, 99])  # a later field it does not know is ignored
    assert (result.cells, result.increased, result.dropped_old, result.dropped_future) == (15, 3, 1, 1)
    assert (result.unknown_rule, result.relayed, result.own_ahead) == (3, 4, 2)


async def test_an_honest_echo_of_an_own_bucket_already_passed_is_dropped_as_old_not_refused(
    region: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis
) -> None:
    """A peer relays this region's own cells; by the time the message is merged the key's
    ring (or the window) has moved past their bucket. They are old, like a peer slot's
    cells of that bucket, and the rest of the message merges."""
    limiter, store = region
    start = CLOCK()
    try:
        for _ in range(4):
            await limiter.hit("api", "u")
        own = _own_slot(limiter, redis_client, b"u")
        echo = [("api", b"u", BUCKET, own, 4 * SUBSTEPS, 0), ("api", b"v", BUCKET, "p1/a", 2 * SUBSTEPS, 0)]
        CLOCK.advance(API.window + 3)  # the window has moved past BUCKET
        await limiter.hit("api", "u")  # the own key's head moves on: BUCKET left its ring
        result = await store.merge_blobs(blobs_from_cells(limiter.layout, echo), "p1")
        assert result.dropped_old == 2  # both: the echo and the peer's cell of the same bucket
        assert (await limiter.usage("api", "u")).by_region == {"r": 1}
        # In the current bucket, an echo above what this region counted is still refused.
        fresh = [("api", b"u", CLOCK.now_us() // API.resolution_us, own, 9 * SUBSTEPS, 0)]
        with pytest.raises(ProtocolError, match="receiver's own slot"):
            await store.merge_blobs(blobs_from_cells(limiter.layout, fresh), "p1")
    finally:
        CLOCK.set(start)

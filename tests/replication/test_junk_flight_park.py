"""In-flight slots and parking keys of another type (junk) are deleted where they are met.

``<tag>#f:<peer>:<slot>`` (an in-flight batch: ``pack.lua`` writes it, ``settle.lua``
concludes it), ``<tag>#pk`` and ``<tag>#pz`` (cells parked ahead of the clock-skew
tolerance: ``merge.lua`` writes them, ``unpark.lua`` releases them) set to a string
used to fail their scripts with WRONGTYPE for as long as they stayed:

* a junk slot made ``pack.lua`` fail after it had taken the batch out of the outbox
  (the shard's changes never reached the peer), and ``settle.lua`` fail for good: an
  agent starting with it (it returns every slot first) failed every round, replicating
  nothing at all;
* a junk parking key made every merge that parked a cell fail (the sender's message
  answered 503, sent again and again, never merged), and ``unpark.lua`` fail every
  round once a parked cell was due: the cells were never released and the agent's
  rounds failed before sending anything.

Now the script that meets WRONGTYPE deletes such a key (only of the wrong type), goes
on, and the agent logs and counts it (``junk_keys``). Real redis-servers; ManualClock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.replication import wire
from geolimit.replication.auth import Signer
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)  # 1 s buckets: a clock-skew tolerance of 2 buckets
SUBJECT = b"s7"


def _tag(subject: bytes = SUBJECT) -> bytes:
    layout = KeyLayout()
    return layout.tag(layout.shard_of(subject))


def _junk(client: redis.Redis, key: bytes) -> None:
    client.delete(key)
    client.set(key, "junk")


# -- in-flight slots, on the store -------------------------------------------------


@pytest.fixture
async def region_a(redis_url: str) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore]]:
    """Region a with peer b on the flushed Redis; one hit on SUBJECT waits in b's outbox."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="a", rules=[API], clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "a", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=["b"])
    await store.drain(peer_ages={"b": 0})
    assert (await limiter.hit("api", SUBJECT)).allowed
    assert sum((await store.drain(peer_ages={"b": 0})).pending["b"].values()) == 1
    yield limiter, store
    await limiter.aclose()


def _same_shard(n: int) -> list[bytes]:
    """``n`` subjects of SUBJECT's shard, SUBJECT first."""
    layout = KeyLayout()
    shard = layout.shard_of(SUBJECT)
    return [SUBJECT, *(s for s in (b"t%d" % i for i in range(10_000)) if layout.shard_of(s) == shard)][:n]


@pytest.mark.parametrize("partial", [False, True])
async def test_a_pack_into_a_junk_slot_still_sends_the_shards_changes(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis, partial: bool
) -> None:
    """Before, pack.lua took the batch out of the outbox, then failed on the slot: the
    changes were lost. ``partial``: a batch of one of the outbox's three keys (HDEL)."""
    limiter, store = region_a
    shard = limiter.layout.shard_of(SUBJECT)
    subjects = _same_shard(3 if partial else 1)
    for subject in subjects[1:]:
        assert (await limiter.hit("api", subject)).allowed
    await store.drain(peer_ages={"b": 0})
    _junk(redis_client, _tag() + b"#f:b:0")
    packed = await store.pack("b", 0, [shard], 1)
    assert (packed.keys, packed.cells) == (1, 1)
    assert packed.left == {shard: len(subjects) - 1}
    assert store.junk.take() == 1
    assert redis_client.type(_tag() + b"#f:b:0") == b"hash"
    await store.settle("b", 0, [shard], delivered=True)
    assert redis_client.exists(_tag() + b"#f:b:0") == 0
    sent = 1
    while sent < len(subjects):  # the rest, one a message, through the same slot
        packed = await store.pack("b", 0, [shard], 1)
        assert (packed.keys, packed.cells) == (1, 1)
        await store.settle("b", 0, [shard], delivered=True)
        sent += 1
    assert redis_client.exists(_tag() + b"#o:b") == 0
    assert store.junk.take() == 0


@pytest.mark.parametrize("delivered", [False, True])
async def test_settling_a_junk_slot_deletes_it_and_leaves_the_other_slots(
    region_a: tuple[AsyncLimiter, ReplicationStore], redis_client: redis.Redis, delivered: bool
) -> None:
    """Before, settle.lua failed on a junk slot for good: every round's retry of it, and an
    agent's start (``recover``: every slot returned to the outbox) failed."""
    limiter, store = region_a
    shard = limiter.layout.shard_of(SUBJECT)
    assert (await store.pack("b", 0, [shard])).keys == 1  # slot 0 holds the batch (a hash)
    _junk(redis_client, _tag() + b"#f:b:3")
    await store.settle("b", 3, [shard], delivered)
    assert store.junk.take() == 1
    assert redis_client.exists(_tag() + b"#f:b:3") == 0
    _junk(redis_client, _tag() + b"#f:b:5")
    await store.recover()  # the agent's start: slot 0's batch goes back to the outbox, 5 is deleted
    assert store.junk.take() == 1
    assert redis_client.exists(_tag() + b"#f:b:5", _tag() + b"#f:b:0") == 0
    assert redis_client.hkeys(_tag() + b"#o:b") == [_tag() + b":api:" + SUBJECT]
    packed = await store.pack("b", 1, [shard])
    assert (packed.keys, packed.cells) == (1, 1)


# -- in-flight slots, through the agents -------------------------------------------


async def test_an_agent_starting_with_a_junk_slot_replicates(redis_server_factory: Factory) -> None:
    """Before, the start's return of every in-flight slot failed on the junk one, at every
    round: the agent replicated nothing at all (and took Redis for unavailable)."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step(names=["b"])
        _junk(rs["a"].client(), _tag() + b"#f:b:3")
        await rs.step(names=["a"])  # its first drain starts the lease: changes are tracked from now
        assert rs["a"].app().hit("api", SUBJECT).allowed
        await rs.step(names=["a"])
        assert rs["b"].app().usage("api", SUBJECT).total == 1
        engine = rs["a"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1
        assert rs["a"].client().exists(_tag() + b"#f:b:3") == 0


async def test_a_junk_slot_in_use_does_not_lose_the_changes_sent_through_it(redis_server_factory: Factory) -> None:
    """Before, the send through slot 0 emptied the outbox and failed: the hit never reached b
    by the deltas, and slot 0 stayed unusable."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step(3)
        a = rs["a"].app()
        _junk(rs["a"].client(), _tag() + b"#f:b:0")
        assert a.hit("api", SUBJECT).allowed
        await rs.step(names=["a"])
        assert rs["b"].app().usage("api", SUBJECT).total == 1
        assert a.hit("api", SUBJECT).allowed
        await rs.step(names=["a"])
        assert rs["b"].app().usage("api", SUBJECT).total == 2
        engine = rs["a"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1


# -- parking keys ------------------------------------------------------------------


async def _post(rs: Regions, cells: list[tuple[int, str, int]], subject: bytes = SUBJECT) -> int:
    """POST (bucket, slot, count) cells to region b, signed as region a: the answer's status."""
    six = [("api", subject, bucket, slot, count * SUBSTEPS, 0) for bucket, slot, count in cells]
    message = wire.Message(kind="delta", sender="a", dest="b", rules={"api": API.structure}, shards=64,
                           blobs=blobs_from_cells(KeyLayout(), six))
    body = wire.encode(message)
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    clock.advance(0.001)  # a new sequence number (the signer's is its clock in µs)
    headers = Signer(rs.secret, "a", clock).headers(body, "b")
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/gossip", data=body,
                                                          headers=headers) as resp:
        return resp.status


def _bucket(rs: Regions) -> int:
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    return clock.now_us() // API.resolution_us


@pytest.mark.parametrize("suffix", [b"#pk", b"#pz"])
async def test_a_cell_to_park_is_merged_and_released_despite_a_junk_parking_key(
    redis_server_factory: Factory, suffix: bytes
) -> None:
    """Before, the merge failed (503) on the junk key at every retry: the message was
    never merged, neither the parked cell nor the message's other cells."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step(names=["b"])
        client, app = rs["b"].client(), rs["b"].app()
        _junk(client, _tag() + suffix)
        c0 = _bucket(rs)
        assert await _post(rs, [(c0 + 5, "a/x", 7), (c0 + 1, "a/x", 2)]) == 200
        assert client.type(_tag() + b"#pk") == b"hash"
        assert client.type(_tag() + b"#pz") == b"zset"
        rs.clock.advance(3 * API.resolution)  # c0 + 3: bucket c0 + 5 is within the tolerance
        assert app.usage("api", SUBJECT).by_slot == {"a/x": 2}  # the cell within it was merged
        await rs.step(names=["b"])  # released and merged
        rs.clock.advance(2 * API.resolution)  # its bucket is the current one
        assert app.usage("api", SUBJECT).by_slot == {"a/x": 9}
        engine = rs["b"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1


async def test_a_junk_due_times_zset_met_by_a_merge_keeps_the_cells_parked_before(
    redis_server_factory: Factory,
) -> None:
    """The cells parked before ``#pz`` was overwritten (their fields in ``#pk``) are made due
    at once: released and parked again until their bucket comes, never lost."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step(names=["b"])
        client, app = rs["b"].client(), rs["b"].app()
        c0 = _bucket(rs)
        assert await _post(rs, [(c0 + 8, "a/x", 7)]) == 200  # parked (a real #pk and #pz)
        _junk(client, _tag() + b"#pz")
        assert await _post(rs, [(c0 + 6, "a/x", 2)]) == 200
        assert client.hlen(_tag() + b"#pk") == 2
        assert client.zcard(_tag() + b"#pz") == 2  # the cell parked before has a due time again
        await rs.step(names=["b"])  # made due: released, parked again (c0 + 8 is still ahead)
        assert client.hlen(_tag() + b"#pk") == 2
        assert client.zcard(_tag() + b"#pz") == 2
        assert app.usage("api", SUBJECT).total == 0
        rs.clock.advance(6 * API.resolution)  # c0 + 6: bucket c0 + 8 is within the tolerance
        await rs.step(names=["b"])
        rs.clock.advance(2 * API.resolution)
        assert app.usage("api", SUBJECT).by_slot == {"a/x": 9}
        engine = rs["b"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1


async def test_a_junk_due_times_zset_met_by_the_release_keeps_the_parked_cells(redis_server_factory: Factory) -> None:
    """Before, unpark.lua failed at every round once a cell was due: the cell was never merged
    and the agent's rounds failed before sending anything."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step(names=["b"])
        client, app = rs["b"].client(), rs["b"].app()
        c0 = _bucket(rs)
        assert await _post(rs, [(c0 + 5, "a/x", 7)]) == 200
        _junk(client, _tag() + b"#pz")
        rs.clock.advance(3 * API.resolution)
        await rs.step(names=["b"])  # due: the release meets the junk zset, makes the cell due, merges it
        rs.clock.advance(2 * API.resolution)
        assert app.usage("api", SUBJECT).by_slot == {"a/x": 7}
        engine = rs["b"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1


async def test_a_junk_parked_cells_hash_met_by_the_release_does_not_stop_the_agent(
    redis_server_factory: Factory,
) -> None:
    """What ``#pk`` held was overwritten by the junk (anti-entropy brings such cells once
    their bucket is live); the agent's rounds go on and the next cells park and release."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        await rs.step()
        client, app = rs["b"].client(), rs["b"].app()
        c0 = _bucket(rs)
        assert await _post(rs, [(c0 + 5, "a/x", 7)]) == 200
        _junk(client, _tag() + b"#pk")
        rs.clock.advance(3 * API.resolution)
        assert app.hit("api", b"mine").allowed
        await rs.step(names=["b"])  # due: the release meets the junk hash and deletes it
        assert rs["a"].app().usage("api", b"mine").total == 1  # b's round went on to send
        assert client.exists(_tag() + b"#pk") == 0
        c1 = _bucket(rs)
        assert await _post(rs, [(c1 + 5, "a/x", 3)]) == 200
        rs.clock.advance(3 * API.resolution)
        await rs.step(names=["b"])
        rs.clock.advance(2 * API.resolution)
        assert app.usage("api", SUBJECT).by_slot == {"a/x": 3}
        engine = rs["b"].agent.engine
        assert engine is not None
        assert engine.stats["junk_keys"] == 1

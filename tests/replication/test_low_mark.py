"""The low mark ``l`` of a data key (design section 2): no cell field lies below it.

``merge.lua`` merges a one-cell key without reading it whole when the mark shows
that the head's move passes over no stored field. If the mark ever claimed more
than is true, a cell M buckets old would be read as a current one. These tests
hold the mark to its claim under merges of one and several cells, this region's
own hits (from a clock behind the one that set the mark, too), and moves of the
clock by less and more than a ring, and check that the counts stay those of the
model and that the short path really is taken.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.gcounter import Cell, KeyState, join
from geolimit.replication.digest import live_range
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells
from tests.support.low_mark import assert_mark_holds

RULE = Rule("api", 10**6, 10, 1)  # N = 10, F = 2, a ring of M = 13 positions
M = RULE.ring
CLOCK = ManualClock(1_700_000_000.0)
BEHIND = ManualClock(1_700_000_000.0)  # an app whose clock runs behind the agent's
START = 1_700_000_000.0
SLOTS = ["p1/a", "p2/b"]
SUBJECTS = [b"s1", b"s2", b"s3"]


Regions = tuple[ReplicationStore, AsyncLimiter, AsyncLimiter]


@pytest.fixture
async def regions(redis_url: str) -> AsyncIterator[Regions]:
    """The merging store, a limiter on the agent's clock and an app whose clock runs behind."""
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], clock=CLOCK)
    app = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], clock=BEHIND)
    yield ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                           peers=["p1", "p2"]), limiter, app
    await limiter.aclose()
    await app.aclose()


def _marks_hold(client: redis.Redis) -> int:
    """Assert the claim of every key's mark; return how many keys have one."""
    return sum(assert_mark_holds(key, client.hgetall(key), M) for key in client.scan_iter(match=b"gl:{*}:api:*"))


step = st.one_of(
    # one cell of one subject (the short path), `ahead` buckets from the clock's
    st.tuples(st.just("one"), st.sampled_from(SUBJECTS), st.integers(-RULE.buckets - 2, RULE.future),
              st.sampled_from(SLOTS), st.integers(1, 200)),
    # several cells of one subject (the general path)
    st.tuples(st.just("many"), st.sampled_from(SUBJECTS), st.integers(-RULE.buckets - 2, RULE.future),
              st.sampled_from(SLOTS), st.integers(1, 200)),
    # this region's own hit, from an app whose clock is `behind` seconds late
    st.tuples(st.just("hit"), st.sampled_from(SUBJECTS), st.integers(0, 6), st.just(""), st.just(0)),
)
steps = st.lists(st.tuples(step, st.sampled_from([0, 0, 1, 2, 3, 5, 11, 12, 13, 14, 30])), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps)
async def test_no_cell_lies_below_a_keys_low_mark_and_counts_stay_the_joins(
    regions: Regions, redis_client: redis.Redis, drawn: list[tuple[tuple[str, bytes, int, str, int], int]],
) -> None:
    store, _, app = regions
    redis_client.flushdb()
    CLOCK.set(START)
    model: dict[bytes, KeyState] = {}
    for (kind, subject, offset, slot, value), advance in drawn:
        CLOCK.advance(advance)
        now = CLOCK.now_us() // RULE.resolution_us
        if kind == "hit":
            BEHIND.set_us(CLOCK.now_us() - offset * 1_000_000)
            await app.hit("api", subject)
        else:
            bucket = now + offset
            cells = [("api", subject, bucket, slot, value * 64, 0)]
            if kind == "many":  # a second cell of the same key, a bucket earlier
                cells.append(("api", subject, bucket - 1, slot, value * 64, 0))
            await store.merge_blobs(blobs_from_cells(store.layout, cells), "p1")
            for _, _, b, s, v, w in cells:
                if now - RULE.buckets <= b <= now + RULE.future:
                    model[subject] = join(model.get(subject, {}), {b: {s: Cell(v, w)}})
        _marks_hold(redis_client)
        # (a field the short path failed to clear reads as a newer bucket's: only the counts show it)
        live = await store.read_live(CLOCK.now_us())
        low, high = live_range(RULE, CLOCK.now_us())
        for subject in SUBJECTS:
            got = {(b, s): (v, w) for b, s, v, w in live.get(("api", subject), []) if s in SLOTS}
            want = {(b, s): (c.value, c.floor) for b, slots in model.get(subject, {}).items()
                    for s, c in slots.items() if low <= b <= high}
            assert got == want, subject


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_one_cell_key_whose_head_moves_is_merged_without_reading_it_whole(
    regions: Regions, redis_client: redis.Redis,
) -> None:
    """P8's shape: every round a new bucket for every key. After the round that
    creates the keys, no merge reads a key whole, and the counts are right."""
    store, _, _ = regions
    CLOCK.set(START)
    subjects = [b"k%d" % i for i in range(200)]
    for round_ in range(6):
        now = CLOCK.now_us() // RULE.resolution_us
        before = _calls(redis_client, "hgetall")
        cells = [("api", s, now, "p1/a", 64 * (round_ + 1), 0) for s in subjects]
        await store.merge_blobs(blobs_from_cells(store.layout, cells), "p1", gap_us=2_000_000)
        assert _calls(redis_client, "hgetall") == before, f"round {round_} read keys whole"
        CLOCK.advance(2)
    assert _marks_hold(redis_client) == len(subjects)
    live = await store.read_live(CLOCK.now_us())
    start = int(START)
    # buckets start, +2, ..., +10; now is start + 12: window [start + 2, start + 14]
    assert sorted(live[("api", b"k7")]) == [(start + 2 * r, "p1/a", 64 * (r + 1), 0) for r in range(1, 6)]


async def test_a_cell_a_ring_old_is_cleared_when_the_head_comes_round_to_it(
    regions: Regions, redis_client: redis.Redis,
) -> None:
    """A sparse key: one cell, then cells that move its head a few buckets at a time
    until its ring position comes round. The old cell must be gone, not read as the
    new bucket's: the mark ends the short path in time."""
    store, limiter, _ = regions
    CLOCK.set(START)
    c0 = CLOCK.now_us() // RULE.resolution_us
    await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", c0, "p1/a", 64 * 7, 0)]), "p1")
    for step_ in (4, 4, 4, 1):  # the head reaches c0 + 13, the ring position of c0
        CLOCK.advance(step_)
        now = CLOCK.now_us() // RULE.resolution_us
        await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", now, "p2/b", 64, 0)]), "p1")
        _marks_hold(redis_client)
    assert CLOCK.now_us() // RULE.resolution_us == c0 + M
    usage = await limiter.usage("api", "s")
    # the window is c0 + 3 .. c0 + 13: the cells of c0 + 4, + 8, + 12 and + 13, not c0's 7
    assert (usage.total, usage.by_slot) == (4, {"p2/b": 4})


async def test_a_cell_exactly_at_the_mark_is_cleared_by_a_head_a_ring_ahead(
    regions: Regions, redis_client: redis.Redis,
) -> None:
    """A new key's first cell 5 buckets old sets the mark at its bucket; a cell a
    ring later takes the position of that bucket, which must be cleared first."""
    store, limiter, _ = regions
    CLOCK.set(START)
    c0 = CLOCK.now_us() // RULE.resolution_us
    for cell in [("api", b"s", c0 - 5, "p1/a", 64 * 7, 0), ("api", b"s", c0, "p2/b", 64, 0)]:
        await store.merge_blobs(blobs_from_cells(store.layout, [cell]), "p1")
    CLOCK.advance(8)
    await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", c0 - 5 + M, "p2/b", 64, 0)]), "p1")
    _marks_hold(redis_client)
    usage = await limiter.usage("api", "s")  # the window: c0 - 2 .. c0 + 8
    assert (usage.total, usage.by_slot) == (2, {"p2/b": 2})


async def test_an_app_whose_clock_runs_behind_lowers_the_mark(regions: Regions, redis_client: redis.Redis) -> None:
    """A merge sets the mark from the agent's clock; an app hitting from 5 s behind
    writes a bucket below it, and must lower the mark with it."""
    store, _, app = regions
    CLOCK.set(START)
    c0 = CLOCK.now_us() // RULE.resolution_us
    await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", c0, "p1/a", 64, 0)]), "p1")
    key = next(iter(redis_client.scan_iter(match=b"gl:{*}:api:s")))
    assert int(redis_client.hget(key, "l")) == c0 - RULE.future
    BEHIND.set(START - 5)
    assert (await app.hit("api", "s")).allowed
    assert int(redis_client.hget(key, "l")) == c0 - 5
    assert _marks_hold(redis_client) == 1


async def test_a_key_a_hit_creates_for_the_agent_has_a_mark_and_a_peers_cell_needs_no_whole_read(
    regions: Regions, redis_client: redis.Redis,
) -> None:
    """With the agent's lease held, a key created by a hit gets its mark (the agreed
    clock's bucket less the future tolerance); without an agent, keys carry no mark."""
    store, limiter, _ = regions
    CLOCK.set(START)
    c0 = CLOCK.now_us() // RULE.resolution_us
    assert (await limiter.hit("api", "alone")).allowed  # no agent yet: no lease
    await store.drain(peer_ages={"p1": 0, "p2": 0})  # the agent's round: it takes the lease
    assert (await limiter.hit("api", "s")).allowed
    alone = next(iter(redis_client.scan_iter(match=b"gl:{*}:api:alone")))
    key = next(iter(redis_client.scan_iter(match=b"gl:{*}:api:s")))
    assert redis_client.hget(alone, "l") is None
    assert int(redis_client.hget(key, "l")) == c0 - RULE.future
    CLOCK.advance(3)
    before = _calls(redis_client, "hgetall")
    await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", c0 + 3, "p1/a", 64 * 2, 0)]), "p1")
    assert _calls(redis_client, "hgetall") == before
    usage = await limiter.usage("api", "s")
    assert (usage.total, usage.by_slot.get("p1/a")) == (3, 2)
    assert _marks_hold(redis_client) == 1

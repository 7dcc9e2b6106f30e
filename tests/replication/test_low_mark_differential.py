"""The low mark ``l`` changes what a merge reads, never what a key holds.

Each example runs one sequence of writes twice on real Redis: once as it is, and
once with every key's mark deleted after each step (so every merge takes the
whole read, as before the mark existed). After every step both runs must hold
the same fields in every data key (all but ``l`` and the expiry mark ``e``, which
follows Redis TIME), and in the first run every mark must hold its claim (no value
or floor field of a bucket below it). A mark that claimed too much would let a
head's move keep a field it should clear: a field a ring old, read as a newer
bucket's, differs from the second run's.

The steps mix what writes data keys: peers' blobs of one cell (the short path) and
of several (the general path), with values and floors, in delta and repair mode,
with and without a gap (prediction's rise fields); a blob whose first key has
more than 32 fields, so that the call reads the keys after it by name (``dense``);
this region's hits from app clocks behind and ahead of the agent's, batched, on
strict, approximate and tight rules; resets; changes of the clock correction
``k``; keys that expire; parked cells released; the agent's drain (its lease,
with which a hit's new key gets a mark); and a rule whose ring (303) is never
read whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells
from tests.support.low_mark import assert_mark_holds

API = Rule("api", 10**6, 10, 1)  # N 10, F 2, M 13
LONG = Rule("long", 10**6, 300, 1)  # M 303: keys read by name, never the short path
APX = Rule("apx", 10**6, 10, 1, mode="approximate")
TIGHT = Rule("tight", 5, 10, 1)  # hits denied too
RULES = {r.name: r for r in (API, LONG, APX, TIGHT)}
CLOCK = ManualClock(1_700_000_000.0)  # the agent's
APP = ManualClock(1_700_000_000.0)  # an app's: set ahead of or behind the agent's per step
START = 1_700_000_000.0
SLOTS = ["p1/a", "p2/b", "p1/old", "p3/c"]
SUBJECTS = [b"s1", b"s2", b"s3"]

Env = tuple[ReplicationStore, AsyncLimiter]
Drawn = list[tuple[tuple[Any, ...], int]]


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    # one shard: the keys of a blob go to one merge call (dense reads follow a big key)
    app = AsyncLimiter.from_url(redis_url, region="r", rules=RULES.values(), clock=APP, shards=1)
    agent = AsyncLimiter.from_url(redis_url, region="r", rules=RULES.values(), clock=CLOCK, shards=1)
    yield ReplicationStore(agent.store, agent.layout, "r", agent.rules, b"n0", now_us=CLOCK.now_us,
                           peers=["p1", "p2", "p3"]), app
    await app.aclose()
    await agent.aclose()


def _cells(rules: list[str], subjects: list[bytes], low: int, high: int, most: int) -> st.SearchStrategy[Any]:
    cell = st.tuples(st.sampled_from(rules), st.sampled_from(subjects), st.integers(low, high),
                     st.sampled_from(SLOTS), st.integers(0, 300), st.integers(0, 300))
    return st.lists(cell, min_size=1, max_size=most)


def _ops(rules: list[str], subjects: list[bytes], one: int) -> st.SearchStrategy[Any]:
    merge_one = st.tuples(st.just("merge"), _cells(rules, subjects, -API.buckets - 1, API.future + 1, 1),
                          st.booleans(), st.sampled_from([0, 500_000]))
    return st.one_of(
        *([merge_one] * one),
        st.tuples(st.just("merge"), _cells(list(RULES), SUBJECTS, -API.buckets - 3, API.future + 4, 12),
                  st.booleans(), st.sampled_from([0, 500_000])),
        st.tuples(st.just("bulk"), st.sampled_from(SUBJECTS), st.integers(-3, 2), st.booleans()),
        st.tuples(st.just("hit"), st.lists(st.tuples(st.sampled_from(list(RULES)), st.sampled_from(subjects)),
                                           min_size=1, max_size=4), st.integers(-8, 4), st.integers(1, 3)),
        st.tuples(st.just("reset"), st.sampled_from(list(RULES)), st.sampled_from(subjects), st.integers(-4, 2)),
        st.tuples(st.just("k"), st.sampled_from([-20_000_000, -3_000_000, -1_000_000, 0, 1_500_000, 3_000_000,
                                                  14_000_000])),
        st.tuples(st.just("expire"), st.sampled_from(list(RULES)), st.sampled_from(subjects)),
        st.tuples(st.just("release")),
        st.tuples(st.just("drain")),
    )


ADVANCES = [0, 0, 1, 1, 2, 3, 4, 6, 11, 12, 13, 14, 26, 30]  # seconds: rings of 13
mixed = st.lists(st.tuples(_ops(list(RULES), SUBJECTS, 1), st.sampled_from(ADVANCES)), min_size=1, max_size=40)
# mostly one-cell blobs on two subjects and small moves: the short path most of the time
short = st.lists(st.tuples(_ops(["api", "api", "apx", "tight"], SUBJECTS[:2], 4), st.sampled_from(ADVANCES[:10])),
                 min_size=1, max_size=60)


def _snapshot(client: redis.Redis, strip: bool) -> dict[bytes, dict[bytes, bytes]]:
    """Every data key's fields but 'l' and 'e'; asserts every mark's claim first."""
    out = {}
    for key in sorted(client.scan_iter(match=b"gl:{*}:*")):
        fields = client.hgetall(key)
        ring = RULES[key.split(b":")[2].decode()].ring
        assert_mark_holds(key, fields, ring)
        if strip and b"l" in fields:
            client.hdel(key, b"l")
        out[key] = {n: v for n, v in fields.items() if n not in (b"l", b"e")}
    return out


async def _run(env: Env, client: redis.Redis, drawn: Drawn, strip: bool) -> list[dict[bytes, dict[bytes, bytes]]]:
    store, app = env
    client.flushdb()
    CLOCK.set(START)
    store.parked.due.clear()
    registry = store.layout.registry_key(0)
    snaps, k = [], 0
    for item, advance in drawn:
        CLOCK.advance(advance)
        now = (CLOCK.now_us() + k) // 1_000_000  # the region clock's bucket (1 s buckets)
        kind = item[0]
        if kind == "merge":
            _, cells, repair, gap = item
            got = [(r, s, now + off, slot, v, w) for r, s, off, slot, v, w in cells]
            await store.merge_blobs(blobs_from_cells(store.layout, got), "p1", repair=repair, gap_us=gap)
        elif kind == "bulk":  # a key of 36 cells (72 fields), then one cell of each other subject
            _, subject, off, repair = item
            big = [("api", subject, now + off - d, slot, 64 * (d + 1), 0) for d in range(12) for slot in SLOTS[:3]]
            small = [("api", s, now + off, "p2/b", 64 * 50, 0) for s in SUBJECTS if s != subject]
            await store.merge_blobs(blobs_from_cells(store.layout, big + small), "p1", repair=repair)
        elif kind == "hit":
            _, requests, off, cost = item
            APP.set_us(CLOCK.now_us() + off * 1_000_000)
            await app.hit_many([(r, s, cost) for r, s in requests])
        elif kind == "reset":
            _, rule, subject, off = item
            APP.set_us(CLOCK.now_us() + off * 1_000_000)
            await app.reset(rule, subject)
        elif kind == "k":
            k = item[1]
            client.hset(registry, "k", k)
        elif kind == "expire":
            client.delete(store.layout.data_key(item[1], item[2]))
        elif kind == "release":
            await store.parked.release(CLOCK.now_us() + k)
        elif kind == "drain":
            await store.drain(peer_ages={"p1": 0, "p2": 0, "p3": 0}, clock_correction_us=k)
        snaps.append(_snapshot(client, strip))
    return snaps


async def _compare(env: Env, client: redis.Redis, drawn: Drawn) -> None:
    marked = await _run(env, client, drawn, strip=False)
    unmarked = await _run(env, client, drawn, strip=True)
    for i, (a, b) in enumerate(zip(marked, unmarked, strict=True)):
        assert a == b, f"after step {i} ({drawn[i]}), the run with marks holds other fields"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mixed)
async def test_every_write_holds_the_same_fields_with_and_without_marks(
    env: Env, redis_client: redis.Redis, drawn: Drawn,
) -> None:
    await _compare(env, redis_client, drawn)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(short)
async def test_one_cell_merges_on_the_short_path_hold_the_same_fields_as_whole_reads(
    env: Env, redis_client: redis.Redis, drawn: Drawn,
) -> None:
    await _compare(env, redis_client, drawn)

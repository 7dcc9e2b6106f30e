"""merge.lua takes a shorter path for a key with one cell (``merge_one``) than for a
key with several: both must leave the same state, the rises recorded for prediction
and the keys queued for relay included.

Two stores on one real Redis (prefixes ``a`` and ``b``) get the same cells from the
same clock: ``a`` as they come (mostly one cell a key), ``b`` with every cell twice
(two cells a key: the general path, which keeps the larger of a cell given twice).
Heads move by less and by more than a ring, so stale positions are cleared and
whole keys dropped on both paths.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

RULE = Rule("api", 10**6, 10, 1)  # N = 10 buckets, F = 2 future buckets
CLOCK = ManualClock(1_700_000_000.0)
START = 1_700_000_000.0
SLOTS = ["p1/a", "p2/b", "p3/c"]

cells = st.lists(
    st.tuples(st.sampled_from([b"s1", b"s2", b"s3"]), st.integers(-RULE.buckets - 3, RULE.future + 3),
              st.sampled_from(SLOTS), st.integers(0, 3 * 64), st.integers(0, 64)),
    max_size=30,
)
advances = st.lists(st.sampled_from([0, 0, 1, 2, 5, 12, 13, 20]), min_size=5, max_size=5)


@pytest.fixture
async def stores(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[tuple[ReplicationStore, ReplicationStore]]:
    made = []
    for prefix in ("a", "b"):
        limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], prefix=prefix, clock=CLOCK)
        made.append((limiter, ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0",
                                               now_us=CLOCK.now_us, peers=["p1", "p2", "p3"])))
    yield made[0][1], made[1][1]
    for limiter, _ in made:
        await limiter.aclose()


def _state(client: redis.Redis, prefix: bytes) -> dict[bytes, dict[bytes, bytes]]:
    """Every hash of a prefix (data keys, outboxes, registries) by name, and the data keys
    that outboxes name, without the prefix. Left out: expiry marks (``e``), which come from Redis's own clock, low
    marks (``l``: each path keeps its own lower bound, checked by ``tests/replication/test_low_mark.py``), and this
    region's own incarnation in the registries (``@``, ``r/...``), made at random."""
    out = {}
    for key in client.scan_iter(match=prefix + b":*"):
        if client.type(key) == b"hash":
            fields = client.hgetall(key).items()
            out[key[len(prefix):]] = {f.removeprefix(prefix + b":"): v for f, v in fields  # outboxes name keys
                                      if f not in (b"e", b"l", b"@") and not f.startswith(b"r/")}
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cells, advances, st.randoms(use_true_random=False))
async def test_a_key_with_one_cell_ends_as_it_would_by_the_general_path(
    stores: tuple[ReplicationStore, ReplicationStore], redis_client: redis.Redis,
    drawn: list[tuple[bytes, int, str, int, int]], moves: list[int], rng: random.Random,
) -> None:
    one, general = stores
    redis_client.flushdb()
    CLOCK.set(START)
    rng.shuffle(drawn)
    for n, start in enumerate(range(0, len(drawn), 5)):
        CLOCK.advance(moves[n % len(moves)])
        now = CLOCK.now_us() // RULE.resolution_us
        batch = [("api", s, now + offset, slot, v, f) for s, offset, slot, v, f in drawn[start : start + 5]]
        gap = (n % 2) * 100_000  # every other message a delta: rises recorded for prediction
        await one.merge_blobs(blobs_from_cells(one.layout, batch), "p1", relay_to=["p2"], gap_us=gap)
        twice = [cell for cell in batch for _ in range(2)]
        await general.merge_blobs(blobs_from_cells(general.layout, twice), "p1", relay_to=["p2"], gap_us=gap)
    assert _state(redis_client, b"a") == _state(redis_client, b"b")

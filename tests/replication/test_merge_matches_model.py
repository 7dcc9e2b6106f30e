"""merge.lua against the model: whatever the order and duplication, Redis holds the join.

Cells are drawn around the live window (far past and far future included, which
merge.lua drops), for three peers with values and reset floors; each example
merges them in random batches, order and duplication, then compares every live
cell in Redis with the model's join (geolimit.core.gcounter).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.gcounter import Cell, KeyState, join
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

RULE = Rule("api", 10**6, 10, 1)  # N = 10 buckets, F = 2 future buckets
CLOCK = ManualClock(1_700_000_000.0)
NOW_BUCKET = CLOCK.now_us() // RULE.resolution_us
PEERS = ["p1", "p2", "p3"]
SLOTS = ["p1/a", "p2/b", "p3/c", "p1/old"]  # p1's older incarnation too

cells = st.lists(
    st.tuples(
        st.sampled_from([b"s1", b"s2"]),
        st.integers(NOW_BUCKET - RULE.buckets - 4, NOW_BUCKET + RULE.future + 4),
        st.sampled_from(SLOTS),
        st.integers(0, 2**20),
        st.integers(0, 2**20),
    ),
    max_size=40,
)


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[ReplicationStore]:
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], clock=CLOCK)
    yield ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us, peers=PEERS)
    await limiter.aclose()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cells, st.randoms(use_true_random=False), st.integers(1, 3))
async def test_merged_state_is_the_join_of_every_cell_in_the_window(
    store: ReplicationStore, drawn: list[tuple[bytes, int, str, int, int]], rng: random.Random, copies: int
) -> None:
    await store.store.client().flushdb()
    deliveries = [c for c in drawn for _ in range(copies)]  # duplicates ...
    rng.shuffle(deliveries)  # ... in any order
    model: dict[bytes, KeyState] = {}
    for start in range(0, len(deliveries), 7):  # in several messages
        batch = deliveries[start : start + 7]
        await store.merge_blobs(
            blobs_from_cells(store.layout, [("api", s, b, slot, v, f) for s, b, slot, v, f in batch]), "p1"
        )
        for subject, bucket, slot, value, floor in batch:
            if NOW_BUCKET - RULE.buckets <= bucket <= NOW_BUCKET + RULE.future and (value or floor):
                model[subject] = join(model.get(subject, {}), {bucket: {slot: Cell(value, floor)}})
    live = await store.read_live(CLOCK.now_us())
    got = {subject: {(b, slot): (v, f) for b, slot, v, f in found} for (_, subject), found in live.items()}
    want = {
        subject: {(b, slot): (c.value, c.floor) for b, slots in state.items() for slot, c in slots.items()}
        for subject, state in model.items()
    }
    assert got == {s: w for s, w in want.items() if w}

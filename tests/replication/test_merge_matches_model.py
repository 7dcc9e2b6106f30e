"""merge.lua against the model: whatever the order and duplication, Redis holds the join.

Cells are drawn around the live window (far past and far future included, which
merge.lua drops), for three peers with values and reset floors; each example
merges them in random batches, order and duplication, with the clock moving on
between batches (by up to more than a ring, so heads move and ring positions are
reused), then compares every live cell in Redis with the model's join
(geolimit.core.gcounter). Two rules: merge.lua
reads keys of the short one whole (HGETALL) and keys of the long one field by
field (HMGET; its ring of 303 positions makes a key potentially large), so both
ways of clearing the positions a moving head passes over are compared. It runs on
the standalone server and on the 3-master cluster (``backend_url``): there the
merge calls of a message go to every master and ``read_live`` scans them all.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.gcounter import Cell, KeyState, join
from geolimit.replication.digest import live_range
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

RULE = Rule("api", 10**6, 10, 1)  # N = 10 buckets, F = 2 future buckets
LONG = Rule("long", 10**6, 300, 1)  # N = 300, M = 303
RULES = {r.name: r for r in (RULE, LONG)}
CLOCK = ManualClock(1_700_000_000.0)  # moved by each example, set back to START first
START = 1_700_000_000.0
PEERS = ["p1", "p2", "p3"]
SLOTS = ["p1/a", "p2/b", "p3/c", "p1/old"]  # p1's older incarnation too


def _cell(rule: Rule) -> st.SearchStrategy[tuple[str, bytes, int, str, int, int]]:
    """A cell with its bucket relative to the clock's when it is merged."""
    return st.tuples(
        st.just(rule.name),
        st.sampled_from([b"s1", b"s2"]),
        st.integers(-rule.buckets - 4, rule.future + 4),
        st.sampled_from(SLOTS),
        st.integers(0, 2**20),
        st.integers(0, 2**20),
    )


cells = st.lists(st.one_of(_cell(RULE), _cell(LONG)), max_size=40)
# seconds the clock moves on before each batch: within a bucket, a few buckets, a
# ring of the short rule (13), half and all of the long one's (303)
advances = st.lists(st.sampled_from([0, 0, 0, 1, 2, 5, 12, 13, 20, 150, 300, 310]), min_size=6, max_size=6)


@pytest.fixture
async def store(backend_url: str) -> AsyncIterator[ReplicationStore]:
    limiter = AsyncLimiter.from_url(backend_url, region="r", rules=[RULE, LONG], clock=CLOCK)
    yield ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us, peers=PEERS)
    await limiter.aclose()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cells, advances, st.randoms(use_true_random=False), st.integers(1, 3))
async def test_merged_state_is_the_join_of_every_cell_in_the_window(
    store: ReplicationStore, drawn: list[tuple[str, bytes, int, str, int, int]], moves: list[int],
    rng: random.Random, copies: int,
) -> None:
    await store.store.client().flushdb()
    CLOCK.set(START)
    deliveries = [c for c in drawn for _ in range(copies)]  # duplicates ...
    rng.shuffle(deliveries)  # ... in any order
    model: dict[tuple[str, bytes], KeyState] = {}
    for n, start in enumerate(range(0, len(deliveries), 7)):  # in several messages, as time goes by
        CLOCK.advance(moves[n % len(moves)])
        now = CLOCK.now_us() // RULE.resolution_us
        batch = [(name, s, now + offset, slot, v, f) for name, s, offset, slot, v, f in deliveries[start : start + 7]]
        # every other message as a delta (gap_us): it also records rises for prediction, never a cell
        await store.merge_blobs(blobs_from_cells(store.layout, batch), "p1", gap_us=(n % 2) * 100_000)
        for name, subject, bucket, slot, value, floor in batch:
            rule = RULES[name]
            if now - rule.buckets <= bucket <= now + rule.future and (value or floor):
                key = (name, subject)
                model[key] = join(model.get(key, {}), {bucket: {slot: Cell(value, floor)}})
    live = await store.read_live(CLOCK.now_us())
    got = {key: {(b, slot): (v, f) for b, slot, v, f in found} for key, found in live.items()}
    want: dict[tuple[str, bytes], dict[tuple[int, str], tuple[int, int]]] = {}
    for (name, subject), state in model.items():
        low, high = live_range(RULES[name], CLOCK.now_us())
        cells_in = {(b, slot): (c.value, c.floor) for b, slots in state.items() for slot, c in slots.items()
                    if low <= b <= high}
        if cells_in:
            want[(name, subject)] = cells_in
    assert got == want

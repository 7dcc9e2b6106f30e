"""A peer's rise counts only what its cell's reset floor leaves (design §2, §6, §14).

A peer cell whose value equals its floor (value 640, floor 640) counts 0: ``/v1/usage``
said 0 used, but ``merge.lua`` recorded the value's whole rise (10 units) for prediction,
so ``/v1/peek`` said 985 of 1000 left and larger costs were denied for about a second.
A rise is the rise of the cell's count with floors applied, ``max(0, count(value) -
count(floor))``: so in the model (``ModelStore.merge``). ``merge.lua`` must agree on both
its paths (one cell a key: ``merge_paths.lua``'s ``merge_one``; several: ``merge_apply.lua``,
which ``tests/replication/test_merge_fast_path.py`` keeps equal) record the same
(``counted`` in common.lua). Real redis-server (``redis_url``).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

API = Rule("api", 1000, 10, 1)
SLOT = "b/i1"
GAP_US = 100_000
Setup = tuple[AsyncLimiter, ReplicationStore, ManualClock]


@pytest.fixture
async def setup(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[Setup]:
    """Region a with peer b on the flushed Redis, b's counts a little stale (prediction applies)."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="a", rules=[API], clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "a", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=["b"])
    yield limiter, store, clock
    await limiter.aclose()


async def _deliver(setup: Setup, subject: bytes, cells: list[tuple[int, int]], twice: bool) -> None:
    """b's cells (value, floor) of the current bucket as deltas, one message each; ``twice``:
    every cell given twice in its message (a key with two cells: merge.lua's general path)."""
    limiter, store, clock = setup
    bucket = clock.now_us() // API.resolution_us
    for value, floor in cells:
        batch = [("api", subject, bucket, SLOT, value, floor)] * (2 if twice else 1)
        await store.merge_blobs(blobs_from_cells(limiter.layout, batch), "b", gap_us=GAP_US)


def _rise(client: redis.Redis, limiter: AsyncLimiter, subject: bytes) -> int:
    """The units of b's last rise in the key (0: none recorded)."""
    fields = client.hgetall(limiter.layout.data_key("api", subject))
    rises = [v for f, v in fields.items() if f.startswith(b"p")]
    assert len(rises) <= 1
    return int(rises[0].split(b":")[1]) if rises else 0


def _model_rise(cells: list[tuple[int, int]]) -> int:
    model = ModelStore("a", regions=2)
    for n, (value, floor) in enumerate(cells):
        model.merge("api", b"s", {0: {SLOT: Cell(value, floor)}}, now_us=n + 1, gap_us=GAP_US)
    rise = model.rises.get(("api", b"s"), {}).get(SLOT)
    return rise.units if rise else 0


@pytest.mark.parametrize("twice", [False, True], ids=["one cell", "two cells"])
async def test_a_peer_cell_at_its_floor_reserves_nothing(setup: Setup, redis_client: redis.Redis,
                                                         twice: bool) -> None:
    limiter, store, clock = setup
    subject = secrets.token_bytes(8)
    await store.drain(peer_ages={"b": 0})
    clock.advance_us(10_000)
    await _deliver(setup, subject, [(640, 640)], twice)
    await store.drain(peer_ages={"b": 5_000})  # b current 5 ms before the rise: its rate predicts
    clock.advance_us(200_000)
    assert (await limiter.usage("api", subject)).total == 0
    assert _rise(redis_client, limiter, subject) == 0
    peek = await limiter.peek("api", subject, 1000)
    assert peek.allowed
    assert peek.results[0].remaining == 1000


CASES = [
    ([(640, 640)], 0),  # the value at its floor
    ([(0, 640), (640, 0)], 0),  # the floor first, the value later
    ([(0, 10 * 64), (12 * 64 + 3, 0)], 2),  # a floor of 10 first, then 12: 2 units (not 12)
    ([(0, 10 * 64), (9 * 64, 0)], 0),  # a floor of 10, then 9: nothing
    ([(5 * 64, 0), (12 * 64, 10 * 64)], 5),  # 5, then 12 over 10 counts 2: no new rise (5 stays the last)
]
NO_FLOOR = ([(5 * 64, 0), (8 * 64, 0)], 3)  # the value's rise


@pytest.mark.parametrize(("cells", "units"), [*CASES, NO_FLOOR])
def test_the_model_records_the_rise_of_the_count_with_floors_applied(cells: list[tuple[int, int]],
                                                                     units: int) -> None:
    assert _model_rise(cells) == units


@pytest.mark.parametrize("twice", [False, True], ids=["one cell", "two cells"])
@pytest.mark.parametrize(("cells", "units"), [*CASES, NO_FLOOR])
async def test_lua_records_the_rise_the_model_does(
    setup: Setup, redis_client: redis.Redis, twice: bool, cells: list[tuple[int, int]], units: int
) -> None:
    limiter, _, _ = setup
    subject = secrets.token_bytes(8)
    await _deliver(setup, subject, cells, twice)
    assert _rise(redis_client, limiter, subject) == units


pairs = st.lists(st.tuples(st.integers(0, 4 * SUBSTEPS), st.integers(0, 4 * SUBSTEPS)), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs, st.booleans())
@example([(640, 640)], False)
async def test_lua_and_the_model_record_the_same_rises(setup: Setup, redis_client: redis.Redis,
                                                       cells: list[tuple[int, int]], twice: bool) -> None:
    limiter, _, _ = setup
    subject = secrets.token_bytes(8)
    model = ModelStore("a", regions=2)
    for n, (value, floor) in enumerate(cells):
        await _deliver(setup, subject, [(value, floor)], twice)
        model.merge("api", b"s", {0: {SLOT: Cell(value, floor)}}, now_us=n + 1, gap_us=GAP_US)
        rise = model.rises.get(("api", b"s"), {}).get(SLOT)
        # Lua keeps the last rise; the model too (a message that raises nothing keeps the one before)
        assert _rise(redis_client, limiter, subject) == (rise.units if rise else 0)

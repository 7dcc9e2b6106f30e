"""With remote counts, peer freshness and partition policies, Lua still decides like the model.

Remote updates carry a gap (the time since the peer's previous update; 0: a
repair, which records no rise), so the rate estimate of prediction (the last
rise of each peer slot, ``merge.lua``'s 'p' fields) and the "stopped" rule
(a rise older than the peer's freshness counts nothing) are compared too.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.decision import to_rule_decision
from geolimit.core.gcounter import Cell
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

RULES = [
    Rule("pred", 14, 4, 1),
    Rule("share", 12, 4, 1, partition="share", partition_after=0.5),
    Rule("closed", 12, 4, 1, partition="closed", partition_after=0.5, predict=False),
    Rule("local", 12, 4, 1, predict=False),
    # approximate mode: the margin on the oldest bucket, the split of the room and field 'u'
    Rule("apx", 14, 4, 1, mode="approximate", partition_after=0.5),
]
PEERS = ["east", "west"]
PICK = st.sampled_from([RULES[0], RULES[4], *RULES])  # "pred" and "apx" twice as often: prediction needs a remote rise and a hit on it
SLOTS = ["east/i1", "west/i1", "east/i2"]  # east has two incarnations: their rates add up

ages = st.one_of(st.integers(0, 300_000), st.integers(0, 2_000_000))  # within partition_after, or not
gaps = st.one_of(st.integers(0, 50_000), st.integers(0, 50_000), st.integers(0, 1_500_000))
freshness = st.tuples(st.just("ages"), gaps, st.just(None), st.tuples(ages, ages))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("hit"), gaps, PICK, st.integers(0, 4)),
        st.tuples(st.just("remote"), gaps, PICK,
                  st.tuples(st.sampled_from(SLOTS), st.integers(1, 6), st.sampled_from([0, 1, 100_000, 250_000]))),
        freshness,
    ),
    min_size=5,
    max_size=40,
).flatmap(lambda rest: freshness.map(lambda first: [first, *rest]))  # peers known from the start


@pytest.fixture
async def setup(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[tuple[AsyncLimiter, ReplicationStore, ManualClock]]:
    """Region north on the flushed shared Redis (another test's region there would be refused)."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="north", rules=RULES, clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "north", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=PEERS)
    yield limiter, store, clock
    await limiter.aclose()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
async def test_decisions_with_peers_match_the_model(
    setup: tuple[AsyncLimiter, ReplicationStore, ManualClock], script: list[tuple[str, int, object, object]]
) -> None:
    limiter, store, clock = setup
    await limiter.store.client().flushdb()  # peer freshness is per shard: start every example clean
    subject = secrets.token_bytes(8)
    model = ModelStore("north", regions=3)
    remote_totals: dict[tuple[str, str, int], int] = {}
    for kind, gap, rule, arg in script:
        clock.advance_us(gap)
        now = clock.now_us()
        if kind == "ages":
            ages = dict(zip(PEERS, arg, strict=True))  # type: ignore[arg-type]
            await store.drain(peer_ages=ages)
            model.peer_known = {p: now - a for p, a in ages.items()}
            model.regions = 3
        elif kind == "remote":
            assert isinstance(rule, Rule)
            slot, cost, update_gap = arg  # type: ignore[misc]
            peer = slot.split("/")[0]
            bucket = now // rule.resolution_us
            key = (rule.name, slot, bucket)
            remote_totals[key] = remote_totals.get(key, 0) + cost
            value = remote_totals[key] * SUBSTEPS + 3  # stored as count * SUBSTEPS + first-admission offset
            cells = [(rule.name, subject, bucket, slot, value, 0)]
            await store.merge_blobs(blobs_from_cells(limiter.layout, cells), peer, gap_us=update_gap)
            model.merge(rule.name, subject, {bucket: {slot: Cell(value, 0)}}, now_us=now, gap_us=update_gap)
        else:
            assert isinstance(rule, Rule)
            got = await limiter.hit(rule.name, subject, arg)  # type: ignore[arg-type]
            (want,) = model.hit([rule], subject, arg, now)  # type: ignore[arg-type]
            assert got.results[0].stable_for == want.stable_us / 1e6, (rule.name, model.peer_known)
            assert got.results[0] == to_rule_decision(rule, want), (rule.name, model.peer_known)
            if model.reserve_falls_at(rule, subject, now) is not None:
                event("stable_for cut to when a predicted reserve may shrink")
            event(f"{rule.name} {'allowed' if got.allowed else 'denied'}")
            if rule.predict:
                held = model.reservation(rule, subject, now)
                stopped = any(r.at_us < model.peer_known.get(p.split("/")[0], -1)
                              for p, r in model.rises.get((rule.name, subject), {}).items())
                event(f"pred: {'predicted' if held.predicted else 'nothing predicted'}"
                      f"{', a stopped peer' if stopped else ''}")


ROOM = Rule("room", 100, 10, 1, mode="approximate")  # partition_after 1 s


@pytest.mark.parametrize(("rise_ago_us", "own_old"), [(900_000, 30), (1_100_000, 30), (900_000, 34), (400_000, 0)])
async def test_contested_room_is_split_alike(redis_url: str, redis_client: redis.Redis, rise_ago_us: int,
                                             own_old: int) -> None:
    """The split of contested room (hypothesis above seldom fills a window that far):
    north, east and west admitted ``own_old``, 30 and 30 in one bucket; east and west rose
    by 5 each since; 10.5 s later half that bucket has left the window. North then hits
    40 times in a row with no news from its peers: fresh room shared with every peer,
    uncapped, down to the last unit; and (``own_old`` 0, the bucket 10 s old not yet
    leaving) the window filling faster than partition_after, shared with the peers that
    rose. Lua and the model agree on every decision."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="north", rules=[ROOM], clock=clock)
    store = ReplicationStore(limiter.store, limiter.layout, "north", limiter.rules, b"n0", now_us=clock.now_us,
                             peers=PEERS)
    try:
        await limiter.store.client().flushdb()
        subject = secrets.token_bytes(8)
        model = ModelStore("north", regions=3)
        start = clock.now_us()

        async def ages(east: int, west: int) -> None:
            await store.drain(peer_ages={"east": east, "west": west})
            model.peer_known = {"east": clock.now_us() - east, "west": clock.now_us() - west}

        async def remote(peer: str, count: int, gap_us: int) -> None:
            now = clock.now_us()
            bucket = now // ROOM.resolution_us
            value = count * SUBSTEPS + 3
            cells = [(ROOM.name, subject, bucket, f"{peer}/i1", value, 0)]
            await store.merge_blobs(blobs_from_cells(limiter.layout, cells), peer, gap_us=gap_us)
            model.merge(ROOM.name, subject, {bucket: {f"{peer}/i1": Cell(value, 0)}}, now_us=now, gap_us=gap_us)

        async def hit() -> bool:
            got = await limiter.hit(ROOM.name, subject, 1)
            (want,) = model.hit([ROOM], subject, 1, clock.now_us())
            assert got.results[0] == to_rule_decision(ROOM, want)
            return got.allowed

        await ages(0, 0)
        if own_old:
            for _ in range(own_old):
                await hit()
                clock.advance_us(1)
            await remote("east", 30, 0)
            await remote("west", 30, 0)
        clock.set_us(start + 10_500_000 - rise_ago_us)
        if not own_old:  # a window filling now: 96 of 100 units within the last half second
            await remote("east", 40, 100_000)
            await remote("west", 40, 100_000)
            for _ in range(10):
                await hit()
            clock.set_us(start + 10_400_000 - rise_ago_us + 100_000)
        await remote("east", 5 if own_old else 43, 100_000)  # the bucket's count: a rise of 5, or of 3
        await remote("west", 5 if own_old else 43, 100_000)
        clock.set_us(start + 10_500_000)
        await ages(200_000, 200_000)
        held = model.reservation(ROOM, subject, clock.now_us())
        assert held.predicted > 0, "the peers are reserved a share"
        admitted = 0
        for _ in range(40):
            admitted += await hit()
            clock.advance_us(1)
        assert admitted >= 1, "the last unit goes to someone"
    finally:
        await limiter.aclose()

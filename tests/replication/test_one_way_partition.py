"""A peer whose own messages cannot reach us is partitioned, even though it answers ours.

Region a has a wrong address for b (or its egress to b is blocked): a's deltas never
reach b, while b's deltas reach a and a acknowledges them. b used to count each
acknowledgement as news of a, so a's counts looked current in b for as long as the
fault lasted: b went on deciding on counts that no longer moved, and ``closed`` and
``share`` rules never applied. Only a peer's own deltas (heartbeats included) say how
old its counts are. Real agents and redis-servers on loopback, stepped by hand under a
manual clock.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest

from geolimit import ManualClock, Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions, dead_url

Factory = Callable[..., EmbeddedRedis]
CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed")  # partition_after: 1 s


@pytest.fixture
async def pair(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    async with Regions(redis_server_factory, ["a", "b"], [CLOSED], run_loops=False,
                       clock=ManualClock(time.time())) as rs:
        await rs.step(30)  # 3 s: both hear from each other
        yield rs


async def test_a_peer_that_only_answers_is_partitioned_after_partition_after(pair: Regions) -> None:
    rs = pair
    a, b = rs["a"].app(), rs["b"].app()
    assert a.hit("closed", "user:1").allowed
    assert b.hit("closed", "user:1").allowed
    rs["a"].agent.set_peer_url("b", dead_url())  # a -> b fails; b -> a still works
    await rs.step(20)  # 2 s
    b_engine = rs["b"].agent.engine
    assert b_engine is not None
    assert b_engine.peers["a"].last_ok is not None
    assert rs.clock() - b_engine.peers["a"].last_ok < 0.5  # a answers b...
    assert not b.hit("closed", "user:1").allowed  # ...but b has no news of a's counts
    assert a.hit("closed", "user:1").allowed  # b's deltas reach a: b is current there
    rs["a"].agent.set_peer_url("b", rs.urls["b"])
    await rs.step(10)
    assert b.hit("closed", "user:1").allowed


async def test_a_complete_exchange_makes_a_peer_current_until_its_deltas_would_be_late(
    redis_server_factory: Factory,
) -> None:
    """A region that just started has had no delta from b yet, but its first anti-entropy
    exchange with b compared every bucket: b's counts are as fresh as that exchange's
    start, so a closed rule allows at once (it denied until b's first delta before). Here
    b's deltas cannot reach a at all, so once that freshness is partition_after old, a denies."""
    async with Regions(redis_server_factory, ["a", "b"], [CLOSED], run_loops=False,
                       clock=ManualClock(time.time())) as rs:
        rs["b"].agent.set_peer_url("a", dead_url())  # b -> a fails from the start
        engine = rs["a"].agent.engine
        a = rs["a"].app()
        for _ in range(50):  # a's start-up exchange with b runs in the background of a's rounds
            await rs.step(1, ["a", "b"])
            if engine is not None and engine.peers["b"].ae_ok:
                break
        assert engine is not None
        assert engine.peers["b"].ae_ok == 1
        await rs.step(1, ["a"])  # a's next round publishes b's freshness
        assert a.hit("closed", "user:1").allowed
        await rs.step(20)  # 2 s without a delta from b
        assert not a.hit("closed", "user:1").allowed

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

"""The host's clock steps back (an NTP step) under running agents.

The agents' times are the wall clock's. Before, a peer's last delta then looked newer
than now (ages below zero), so a peer that went silent after the step stayed current
for as long as the step: a closed rule allowed for 10 s instead of about 1 s after its
peer's last delta. And a region's next heartbeat waited for a time the step had put
off. Now the peers' recorded times move back with the clock: the engines' clocks watch every
reading for a step back (geolimit/replication/clock_steps.py), so a time recorded after the
step is never moved twice.

Real agents and real redis-servers on loopback, stepped by hand under a manual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from geolimit import ManualClock, Rule
from geolimit.replication.escrow import EscrowReplicator
from geolimit.server.agent import Agent
from geolimit.store.embedded import EmbeddedRedis
from tests.replication.test_worker_sharing import owned_by
from tests.support.regions import Regions

API = Rule("api", 1000, 60, 10)
CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed")  # denies while a peer's counts are > 1 s old
STEP_BACK = 10.0
Factory = Callable[..., EmbeddedRedis]


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_peer_silent_after_a_step_back_is_partitioned_a_second_later(
    redis_server_factory: Factory, workers: int,
) -> None:
    clock = ManualClock(float(int(time.time()) // 10 * 10))
    async with Regions(redis_server_factory, ["a", "b"], [API, CLOSED], run_loops=False, clock=clock,
                       anti_entropy_interval=3600) as rs:
        agents = [rs["a"].agent]
        if workers > 1:
            await rs["a"].agent.abort()
            config = replace(rs["a"].config, workers=workers)
            agents = [Agent(config, clock=clock, worker_index=i) for i in range(workers)]
            for agent in agents:
                await agent.listen()
                agent.set_peer_url("b", rs.urls["b"])
            rs["b"].agent.set_peer_url("a", agents[0].url)

        async def step(rounds: int, with_b: bool = True) -> None:
            for _ in range(rounds):
                for agent in agents:
                    await agent.step()
                if with_b:
                    await rs["b"].agent.step()
                clock.advance(rs.interval)

        try:
            await step(30)
            a = rs["a"].app()
            subjects = [owned_by(i, workers) for i in range(workers)]
            assert all(a.peek("closed", s).allowed for s in subjects)
            clock.set(clock() - STEP_BACK)
            await step(10)  # 1 s: b healthy, a keeps hearing from it
            assert all(a.peek("closed", s).allowed for s in subjects)
            await rs["b"].agent.abort()  # b is gone
            silent = 0.0
            while any(a.peek("closed", s).allowed for s in subjects):
                await step(1, with_b=False)
                silent += rs.interval
                assert silent < 2.0, "a still takes b as current 2 s after its last delta"
        finally:
            if workers > 1:
                for agent in agents:
                    await agent.abort()


async def test_a_region_s_times_move_back_with_its_clock(redis_server_factory: Factory) -> None:
    """After a step back, a's next heartbeat is not put off by the step (its last attempt is not
    in the future), and no peer's age is below zero."""
    clock_a = ManualClock(float(int(time.time()) // 10 * 10))
    async with Regions(redis_server_factory, ["a", "b"], [API, CLOSED], run_loops=False, clock=clock_a,
                       anti_entropy_interval=3600) as rs:
        b = rs["b"].app()
        for _ in range(30):
            await rs["a"].agent.step()
            await rs["b"].agent.step()
            clock_a.advance(rs.interval)
        assert b.peek("closed", "user-1").allowed
        engine = rs["a"].agent.engine
        assert engine is not None
        before = engine.peers["b"].last_attempt
        clock_a.set(clock_a() - 5.0)
        await rs["a"].agent.step()
        assert engine.peers["b"].last_attempt is not None
        assert before is not None
        assert engine.peers["b"].last_attempt <= clock_a()  # moved back with the clock: due again on time
        assert min(engine.peer_ages(clock_a()).values()) >= 0


async def test_a_delta_that_arrives_between_the_step_and_the_next_round_keeps_its_time(
    redis_server_factory: Factory,
) -> None:
    """The step back was noticed only at a's next round, which then moved b's last delta (already
    on the new clock) back a second time: a's closed rule denied with b healthy, and a's answer
    in between carried a negative reach age, which b refused (a tester's find)."""
    clock = ManualClock(float(int(time.time()) // 10 * 10))
    async with Regions(redis_server_factory, ["a", "b"], [API, CLOSED], run_loops=False, clock=clock,
                       anti_entropy_interval=3600) as rs:
        await rs.step(30)
        a = rs["a"].app()
        assert a.peek("closed", "user-1").allowed
        clock.set(clock() - STEP_BACK)
        rs["b"].app().hit("api", "user-7")  # b's next round sends a delta to a
        await rs["b"].agent.step()
        engine_b = rs["b"].agent.engine
        assert engine_b is not None
        assert engine_b.peers["a"].failures == 0  # a's answer was accepted
        clock.advance(rs.interval)
        await rs["a"].agent.step()
        engine_a = rs["a"].agent.engine
        assert engine_a is not None
        assert engine_a.peer_ages(clock())["b"] < 1_000_000
        assert a.peek("closed", "user-1").allowed


def test_escrow_s_peers_follow_a_step_back() -> None:
    """A dead peer stayed live, and the next pull waited, for as long as the step."""
    clock = ManualClock(1_700_000_000.0)
    escrow = EscrowReplicator("a", ["b"], store=None, rules={}, transport=None, owned=[0],  # type: ignore[arg-type]
                              interval=0.1, timeout=1.0, pull_interval=60.0, now_us=lambda: None, clock=clock)
    peer = escrow.peers["b"]
    peer.last_ok = escrow.clock()
    peer.pull_due = escrow.clock() + 60.0
    assert escrow.live() == {"b"}
    clock.set(clock() - 10.0)  # the host's clock steps back; b dies at that moment
    escrow.clock()  # a round reads the clock
    clock.advance(5.0)
    assert escrow.live() == set()  # 5 s without an answer (the horizon is 1.3 s)
    assert round(peer.pull_due - escrow.clock(), 1) == 55.0

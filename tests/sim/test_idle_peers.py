"""A healthy peer that admits nothing is not taken for a partitioned one.

An idle agent sends only heartbeats. They used to come every second, while a
peer's counts count as partitioned once older than ``partition_after`` (1 s by
default): for the last ~0.1-0.2 s of every second an idle, healthy peer looked
cut off, so ``closed`` rules denied everything and ``share`` rules reserved the
peer's fair share. The heartbeat now follows the rules' ``partition_after``
(:func:`geolimit.replication.peers.heartbeat_for`). Real Lua and the real gossip
engine on a virtual clock.
"""

from __future__ import annotations

from geolimit import Rule
from geolimit.sim import SimCluster

CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed")
SHARE = Rule("share", 100, 60, 6, partition="share")


async def test_a_closed_rule_never_denies_while_its_idle_peer_is_healthy(sim_redis: str) -> None:
    async with SimCluster(sim_redis, ["a", "b"], [CLOSED], seed=1) as sim:
        await sim.advance(3.0)  # the regions hear from each other; then b only sends heartbeats
        denied = []
        for _ in range(500):  # 5 s, a request every 10 ms
            if not (await sim.hit("a", "closed", "user:1")).allowed:
                denied.append(round(sim.now % 100, 2))
            await sim.advance(0.01)
        assert denied == [], f"denied at {denied[:5]}... with b healthy"


async def test_a_share_rule_reserves_nothing_for_a_healthy_idle_peer(sim_redis: str) -> None:
    async with SimCluster(sim_redis, ["a", "b"], [SHARE], seed=1) as sim:
        await sim.advance(3.0)
        for _ in range(60):  # a uses 60 of 100; b uses nothing
            await sim.hit("a", "share", "user:1")
        a = sim.regions["a"].limiter
        assert (await a.usage("share", "user:1")).total == 60
        refused = []
        for _ in range(500):  # then both are idle for 5 s: only heartbeats
            if not (await a.peek("share", "user:1", 40)).allowed:
                refused.append(round(sim.now % 100, 2))
            await sim.advance(0.01)
        assert refused == [], f"a reserved b's fair share at {refused[:5]}... with b healthy"


def test_the_heartbeat_follows_the_shortest_watched_partition_after() -> None:
    from geolimit.replication.peers import heartbeat_for

    assert heartbeat_for(0.1, [Rule("api", 10, 60, 6)]) == 0.25  # partition_after 1 s (default)
    assert heartbeat_for(0.1, [Rule("a", 10, 60, 6), Rule("b", 10, 60, 6, partition_after=8.0)]) == 0.25
    assert heartbeat_for(0.1, [Rule("x", 10, 60, 6, predict=False)]) == 1.0  # nothing watches freshness
    assert heartbeat_for(0.1, [Rule("e", 10, 60, 6, escrow=True)]) == 1.0
    assert heartbeat_for(0.5, [Rule("api", 10, 60, 6)]) == 0.5  # never more often than a round

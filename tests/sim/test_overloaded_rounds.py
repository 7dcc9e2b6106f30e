"""An agent whose gossip rounds fall behind reads its peers as partitioned.

An overloaded agent runs its rounds late (its event loop holds the decisions it was
offered; docs/design.md §14, *Overload*). Its peers' counts are published to its Redis
by those rounds, so once they are older than ``partition_after`` its decisions apply the
partition policy, whatever the peers did meanwhile: with ``closed`` it denies, with
``local`` (the default) it enforces the whole limit alone. Real Lua and the real gossip
engine on a virtual clock; the region's rounds are stopped as an overloaded loop would.
"""

from __future__ import annotations

from geolimit import Rule
from geolimit.sim import SimCluster

CLOSED = Rule("closed", 1_000_000, 10, 1, partition="closed")


async def seconds_until_denied(sim: SimCluster, region: str, within: float = 3.0) -> float | None:
    """Virtual seconds until ``region`` first denies the closed rule (a hit every 10 ms), or
    None if it does not within ``within``."""
    started = sim.now
    while sim.now - started < within:
        await sim.advance(0.01)
        if not (await sim.hit(region, "closed", "user:1")).allowed:
            return sim.now - started
    return None


async def test_a_region_whose_rounds_stop_applies_its_partition_policy_until_they_resume(sim_redis: str) -> None:
    async with SimCluster(sim_redis, ["a", "b"], [CLOSED], seed=1) as sim:
        await sim.advance(3.0)  # in contact
        assert (await sim.hit("a", "closed", "user:1")).allowed
        sim.regions["a"].gossip = False  # a's rounds stop; b's go on
        denied_after = await seconds_until_denied(sim, "a")
        # partition_after (1 s) after the freshness its last round published: b's counts were
        # then an interval and half a round trip old, plus up to a heartbeat since b's news
        assert denied_after is not None, "a kept deciding on b's counts as if they were current"
        assert 0.5 <= denied_after <= 1.0
        sim.regions["a"].gossip = True
        await sim.advance(0.3)  # its next rounds publish b's freshness again
        assert (await sim.hit("a", "closed", "user:1")).allowed


async def test_its_peers_apply_their_partition_policy_too_although_it_answers_them(sim_redis: str) -> None:
    """a's rounds stop while its handler still merges and acknowledges b's deltas. b used
    to count every acknowledgement as news of a, so a's counts looked current in b for as
    long as a's rounds were stuck; only a's own deltas (heartbeats included) say that now."""
    async with SimCluster(sim_redis, ["a", "b"], [CLOSED], seed=1) as sim:
        await sim.advance(3.0)
        assert (await sim.hit("b", "closed", "user:1")).allowed
        sim.regions["a"].gossip = False
        denied_after = await seconds_until_denied(sim, "b")
        assert denied_after is not None, "b kept deciding on a's counts as if they were current"
        # partition_after (1 s) after a's last delta, which came at most a heartbeat (0.25 s) earlier
        assert 0.5 <= denied_after <= 1.25
        assert sim.network.link("b", "a").messages > 0  # b kept reaching a meanwhile
        sim.regions["a"].gossip = True
        await sim.advance(0.5)
        assert (await sim.hit("b", "closed", "user:1")).allowed

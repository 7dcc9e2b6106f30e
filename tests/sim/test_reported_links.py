"""What a peer's report of its own links down asks of this region.

Region a merges b's cells; b's deltas also tell a which peers b cannot reach. Cells
a merged while b's reports showed b -> c up were not relayed to c. They are in b's
outbox to c, which delivers them when the link is back; if it stays down (or b dies)
only an exchange between a and c repairs them. Before, a asked for an exchange of
every bucket with c as soon as one report showed b -> c down, so every short failure
between two other regions (one failed send) cost a a full exchange. Now a asks once
the link has been reported down for five rounds and two retries of a failed send
(0.5 s by default): a send that failed once and went through on its retry asks for
nothing.
"""

from __future__ import annotations

from geolimit.replication.peers import EngineSettings
from tests.sim.harness import INTERVAL, cluster_for
from tests.sim.schedule import Schedule
from tests.sim.test_startup_exchanges import full_exchanges

SUBJECT = b"ns0:0"
SETTINGS = EngineSettings()
PERSIST = max(5 * SETTINGS.interval, 2 * SETTINGS.max_backoff)


async def test_a_short_failure_between_two_other_regions_asks_this_one_for_nothing(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=3, shards=64), sim_redis) as sim:
        await sim.advance(0.3)  # the start-up exchanges are done, deltas flow
        full = full_exchanges(sim, "a")
        sim.network.cut("b", "c", both=False)  # b's deltas cannot reach c
        b, hits = sim.regions["b"], 0
        # b is busy (a hit every round), so its deltas to a carry a fresh report every round
        for _ in range(round(2 * SETTINGS.heartbeat / INTERVAL)):
            await b.limiter.hit("fine", SUBJECT)
            hits += 1
            await sim.advance(INTERVAL)
            if "c" in sim.regions["a"].engine.peers["b"].reported_down:
                break
        assert "c" in sim.regions["a"].engine.peers["b"].reported_down, "b reported the link down"
        sim.network.heal("b", "c", both=False)  # b's retry goes through
        for _ in range(round(2 * PERSIST / INTERVAL)):
            await b.limiter.hit("fine", SUBJECT)
            hits += 1
            await sim.advance(INTERVAL)
        assert "c" not in sim.regions["a"].engine.peers["b"].reported_down, "b reported the link up again"
        await sim.advance(3.0)
        assert (await sim.regions["c"].limiter.usage("fine", SUBJECT)).total == hits, "b's outbox delivered them"
        assert full == [], "nothing was lost: no exchange of every bucket"


async def test_a_link_reported_down_for_longer_asks_for_a_full_exchange_that_repairs(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=3, shards=64), sim_redis) as sim:
        await sim.advance(0.3)
        full = full_exchanges(sim, "a")
        sim.network.cut("b", "c", both=False)  # and it stays cut
        await sim.regions["b"].limiter.hit("fine", SUBJECT)
        await sim.advance(PERSIST / 3)
        assert full == [], "not yet"
        for _ in range(200):
            if "c" in full:
                break
            await sim.advance(INTERVAL)
        # (c's replies to b are cut too, so c reports its link to b down as well: b may come first)
        assert "c" in full, "the link stayed down: a full exchange with c"
        await sim.advance(1.0)
        assert (await sim.regions["c"].limiter.usage("fine", SUBJECT)).total == 1, "c has b's hit through a"

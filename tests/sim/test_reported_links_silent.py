"""A region that reports its link to a peer down and then dies.

Region a merged b's cells while b's reports still showed b -> c up, so a did not
relay them to c; they wait in b's outbox to c. If b dies right after its first
report of the link down, no later report comes (neither down nor up): a must
still ask for an exchange with c once the link has been reported down for two
heartbeats plus two intervals (``Receiver.report_stale``: 2.2 s with the default
settings, less in the simulation, whose heartbeat is shorter; asked for by
``Receiver.lapse_down_reports``), so that c gets b's hits from a. This pins that
the wait counts from the first report, and needs no later one.
"""

from __future__ import annotations

from tests.sim.harness import cluster_for
from tests.sim.schedule import Schedule

KEYS = 500


async def _held_from_b(sim, name: str) -> int:  # type: ignore[no-untyped-def]
    cells = await sim.cells(name)
    return sum(v // 64 - w // 64 for cs in cells.values() for _, slot, v, w in cs if slot.startswith("b/"))


async def test_a_reporter_that_dies_after_reporting_a_link_down_still_gets_its_cells_repaired(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=3, shards=64), sim_redis) as sim:
        await sim.advance(0.5)
        a = sim.regions["a"].engine
        sim.network.cut("b", "c", both=False)
        await sim.regions["b"].limiter.hit_many([("fine", b"k%d" % i, 1) for i in range(KEYS)])
        waited = 0.0
        while "c" not in a.peers["b"].reported_down:
            assert waited < a.report_stale(), "b reported its link to c down"
            await sim.advance(0.01)
            waited += 0.01
        assert await _held_from_b(sim, "a") == KEYS
        assert await _held_from_b(sim, "c") < KEYS, "a merged b's hits before b reported c down: not relayed"
        assert "c" in a.peers["b"].down_reported, "not yet asked for: the report must age first"
        sim.regions["b"].gossip = False  # b dies: no more rounds, no more reports
        sim.network.isolate("b")
        waited = 0.0
        while await _held_from_b(sim, "c") < KEYS:
            # (without the lapse only the periodic exchange would: 30 s on)
            assert waited < a.report_stale() + 8.0, "a's exchange with c brings b's hits soon after the lapse"
            await sim.advance(0.1)
            waited += 0.1

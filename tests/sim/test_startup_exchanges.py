"""Which link events ask for an anti-entropy exchange that compares every bucket.

An exchange that something asked for compares every live bucket, unsettled ones
included; under load every key whose delta is travelling then "differs", and the
exchange lists up to its cap of keys for nothing. A link back up after an outage asks
for one (the outage may have missed something). A peer that was never reached before
(it was still starting when the first delta went out) had no outage: the start-up
exchange covers it. Before, its first acknowledged delta asked for a second full
exchange, which bench/soak.py saw as +15-30 MiB on one agent at 1M keys.
"""

from __future__ import annotations

from typing import Any

from geolimit.sim.cluster import SimCluster
from tests.sim.harness import INTERVAL, cluster_for
from tests.sim.schedule import Schedule

SUBJECT = b"ns0:0"


def full_exchanges(sim: SimCluster, region: str) -> list[str]:
    """Record the peers of ``region``'s exchanges that compare every bucket (settle 0)."""
    ae = sim.regions[region].engine.repair.ae
    run = ae.run
    seen: list[str] = []

    async def recorded(peer: str, settle: float = 0.0) -> Any:
        if settle == 0.0:
            seen.append(peer)
        return await run(peer, settle)

    ae.run = recorded  # type: ignore[method-assign]
    return seen


async def test_a_peer_first_reached_late_gets_no_second_full_exchange(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=2, shards=64), sim_redis) as sim:
        await sim.advance(0.3)  # the start-up exchange is done, deltas flow
        a, limiter = sim.regions["a"].engine, sim.regions["a"].limiter
        peer = a.peers["b"]
        assert peer.ae_ok == 1
        assert not peer.ae_needed
        full = full_exchanges(sim, "a")
        # As on a real start: a's first delta failed (b was not listening yet), so b
        # counts one failure and was never reached.
        peer.failures, peer.last_ok = 1, None
        await limiter.hit("fine", SUBJECT)
        await sim.advance(4 * INTERVAL)
        assert peer.failures == 0, "the delta went through"
        assert peer.last_ok is not None
        assert full == [], "no outage to repair: no second full exchange"
        assert not peer.ae_needed
        assert (await sim.regions["b"].limiter.usage("fine", SUBJECT)).total == 1


async def test_a_link_back_up_after_an_outage_asks_for_a_full_exchange(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=2, shards=64), sim_redis) as sim:
        await sim.advance(0.3)
        a = sim.regions["a"].engine
        full = full_exchanges(sim, "a")
        sim.network.isolate("b")
        await sim.regions["a"].limiter.hit("fine", SUBJECT)
        while not a.peers["b"].failures:
            await sim.advance(INTERVAL)
        sim.network.rejoin("b")
        for _ in range(100):
            if full:
                break
            await sim.advance(INTERVAL)
        assert full == ["b"], "the outage may have missed something: a full exchange repairs it"

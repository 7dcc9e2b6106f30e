"""Which link events ask for an anti-entropy exchange that compares every bucket.

An exchange that something asked for compares every live bucket, unsettled ones
included: under load every key whose delta is travelling then "differs", and the
exchange lists up to its cap of keys for nothing. A link back up after an outage of
``ae_settle`` (10 s) or more asks for one: the outage may have missed something. A
shorter failure (a send that timed out under load, a peer still starting when the
first delta went out) lost nothing, since the outbox kept the changes. Before, the
first acknowledged delta after any failure asked for a full exchange, which
bench/soak.py saw as one more unsettled exchange per agent under full load (+26% RSS
on one agent at 1M keys).
"""

from __future__ import annotations

from typing import Any

from geolimit.replication.peers import EngineSettings
from geolimit.sim.cluster import SimCluster
from tests.sim.harness import INTERVAL, cluster_for
from tests.sim.schedule import Schedule

SUBJECT = b"ns0:0"
SETTLE = EngineSettings().ae_settle


def full_exchanges(sim: SimCluster, region: str) -> list[str]:
    """The peers of ``region``'s completed exchanges that compared every bucket (settle 0)."""
    ae = sim.regions[region].engine.repair.ae
    run = ae.run
    done: list[str] = []

    async def recorded(peer: str, settle: float = 0.0) -> Any:
        result = await run(peer, settle)
        if settle == 0.0:
            done.append(peer)
        return result

    ae.run = recorded  # type: ignore[method-assign]
    return done


async def outage(sim: SimCluster, seconds: float) -> None:
    """b cut off from a for ``seconds`` while a has a hit to send it; then back."""
    a = sim.regions["a"]
    sim.network.isolate("b")
    await a.limiter.hit("fine", SUBJECT)
    await sim.advance(seconds)
    assert a.engine.peers["b"].failures > 0, "a's deltas failed meanwhile"
    sim.network.rejoin("b")


async def test_a_peer_still_starting_gets_the_start_up_exchange_only(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=2, shards=64), sim_redis) as sim:
        full = full_exchanges(sim, "a")
        await outage(sim, 1.0)  # b unreachable from the start: a's first sends fail
        await sim.advance(3.0)
        assert sim.regions["a"].engine.peers["b"].failures == 0, "the link is up"
        assert (await sim.regions["b"].limiter.usage("fine", SUBJECT)).total == 1
        assert full == ["b"], "one full exchange, the start-up one"


async def test_a_short_failure_asks_for_no_full_exchange(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=2, shards=64), sim_redis) as sim:
        await sim.advance(0.3)  # the start-up exchange is done, deltas flow
        full = full_exchanges(sim, "a")
        await outage(sim, SETTLE / 4)
        await sim.advance(3.0)
        assert sim.regions["a"].engine.peers["b"].failures == 0, "the link is up"
        assert (await sim.regions["b"].limiter.usage("fine", SUBJECT)).total == 1, "the outbox delivered it"
        assert full == [], "nothing was lost: no exchange of every bucket"


async def test_a_link_back_up_after_an_outage_asks_for_a_full_exchange(sim_redis: str) -> None:
    async with cluster_for(Schedule(steps=(), regions=2, shards=64), sim_redis) as sim:
        await sim.advance(0.3)
        full = full_exchanges(sim, "a")
        await outage(sim, SETTLE + 1.0)
        for _ in range(100):
            if full:
                break
            await sim.advance(INTERVAL)
        assert full == ["b"], "the outage may have missed something: a full exchange repairs it"

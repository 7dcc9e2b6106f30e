"""Targeted deterministic simulations: one failure mode each, with exact expected counts.

Every scenario runs three regions through the simulator (real Redis and Lua, the
real gossip engine, virtual time, 64 shards as in production) and checks safety
(no view above the truth) after every step, like the property tests. The tests taking
``sim_store_url`` run twice: with the regions on a plain redis-server, and on the
3-master Redis Cluster fixture.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from geolimit.core.window import count_of
from geolimit.replication import wire
from geolimit.replication.gossip import GossipEngine
from geolimit.sim import Faults
from tests.sim.harness import INTERVAL, Harness, cluster_for
from tests.sim.schedule import Schedule
from tests.support.blobs import unblob

SUBJECT = b"ns0:0"  # Schedule(...).subject(0)


@asynccontextmanager
async def harness(base_url: str, regions: int = 3, **options: object) -> AsyncIterator[Harness]:
    schedule = Schedule(steps=(), regions=regions, shards=64, **options)  # type: ignore[arg-type]
    async with cluster_for(schedule, base_url) as sim:
        h = Harness(sim, schedule)
        await sim.advance(0.3)  # first rounds: leases and the initial anti-entropy
        yield h


async def slots(h: Harness, region: str, rule: str = "fine") -> dict[str, int]:
    usage = await h.sim.regions[region].limiter.usage(rule, SUBJECT)
    return {slot: n for slot, n in usage.by_slot.items() if n}


async def test_a_partial_partition_converges_through_the_third_region(sim_store_url: str) -> None:
    async with harness(sim_store_url) as h:
        h.sim.network.cut("a", "b")
        await h.hit("a", SUBJECT, ["fine"], 5)
        await h.hit("b", SUBJECT, ["fine"], 3)
        # a and b stay cut: only c can carry. c's exchanges with a and b wait until their
        # reports have shown the cut for 0.5 s (gossip_receive.report_persist), and an idle
        # region reports only with its heartbeat: up to 18 rounds on the cluster, so 30.
        rounds = await h.converge(rounds_bound=30, heal=False)
        assert h.sim.network.is_cut("a", "b")
        assert h.sim.network.link("a", "b").refused > 0
        for name in "abc":
            usage = await h.sim.regions[name].limiter.usage("fine", SUBJECT)
            assert usage.by_region == {"a": 5, "b": 3}, (name, rounds)
        # c now knows the a-b link is down: later hits are relayed as c merges them.
        await h.hit("a", SUBJECT, ["fine"], 2)
        await h.hit("b", SUBJECT, ["fine"], 1)
        rounds = await h.converge(rounds_bound=20, heal=False)
        assert h.sim.regions["c"].engine.stats["relayed"] > 0
        for name in "abc":
            usage = await h.sim.regions[name].limiter.usage("fine", SUBJECT)
            assert usage.by_region == {"a": 7, "b": 4}, (name, rounds)


class Recorder:
    """Stands in for an engine on the network and notes every cell value as it arrives."""

    def __init__(self, engine: GossipEngine, arrivals: dict[tuple[str, tuple[object, ...]], int]) -> None:
        self.engine = engine
        self.arrivals = arrivals
        self.stale = 0  # cells that arrived lower than a value this region had already received

    async def receive(self, msg: wire.Message) -> wire.Message:
        for rule, subject, bucket, slot, value, _ in unblob(msg.blobs):
            key = (self.engine.region, (rule, subject, bucket, slot))
            if value < self.arrivals.get(key, 0):
                self.stale += 1
            self.arrivals[key] = max(value, self.arrivals.get(key, 0))
        return await self.engine.receive(msg)


async def test_duplicates_and_reordering_never_double_count(sim_redis: str) -> None:
    async with harness(sim_redis, latency=0.05) as h:
        net, names = h.sim.network, h.sim.names
        for a in names:
            for b in names:
                if a < b:
                    net.set_faults(a, b, Faults(duplicate=1.0))  # every message is delivered twice
        net.jitter = 0.3  # delays of 0-0.35 s against 0.1 s between rounds: messages overtake each other
        arrivals: dict[tuple[str, tuple[object, ...]], int] = {}
        recorders = {n: Recorder(h.sim.regions[n].engine, arrivals) for n in names}
        net.receivers.update(recorders)
        rng = random.Random(5)
        for _ in range(60):
            await h.hit(rng.choice(names), SUBJECT, rng.choice([["fine"], ["coarse"], ["fine", "coarse"]]), rng.randint(1, 5))
            await h.sim.advance(rng.choice([0.02, 0.05, 0.1, 0.2]))
            await h.check_safety()
        rounds = await h.converge(rounds_bound=40, heal=False)  # duplicates and jitter stay on
        duplicated = sum(s.duplicated for s in net.stats.values())
        stale = sum(r.stale for r in recorders.values())
        assert duplicated > 100, duplicated
        assert stale > 0, "no cell value arrived after a newer one: the jitter did not reorder"
        assert rounds <= 40


async def test_a_wipe_then_anti_entropy_restores_the_old_incarnation_exactly(sim_store_url: str) -> None:
    async with harness(sim_store_url) as h:
        await h.hit("a", SUBJECT, ["fine"], 10)
        await h.hit("b", SUBJECT, ["fine"], 20)
        await h.sim.advance(0.5)
        assert await h.missing_elsewhere("a") == []  # b and c hold all of a's cells
        before = await slots(h, "b")
        (old,) = [s for s in before if s.startswith("a/")]
        await h.sim.wipe("a")  # a's Redis loses everything
        assert await slots(h, "a") == {}
        await h.hit("a", SUBJECT, ["fine"], 4)  # a new incarnation (no lease yet: only anti-entropy carries it)
        await h.converge(rounds_bound=10, heal=False)
        (new,) = [s for s in await slots(h, "a") if s.startswith("a/") and s != old]
        for name in "abc":
            assert await slots(h, name) == {**before, new: 4}, name
            usage = await h.sim.regions[name].limiter.usage("fine", SUBJECT)
            assert usage.by_region == {"a": 14, "b": 20}, name
        assert h.sim.regions["a"].engine.stats["wipes"] >= 1


async def test_an_agent_restart_loses_nothing(sim_store_url: str) -> None:
    async with harness(sim_store_url) as h:
        h.sim.network.isolate("a")
        await h.hit("a", SUBJECT, ["fine", "coarse"], 7)
        await h.sim.advance(3 * INTERVAL)  # a's agent drains the change into its outboxes; sends fail
        engine = h.sim.regions["a"].engine
        assert all(p.queued for p in engine.peers.values())
        limiter = h.sim.regions["a"].limiter
        client = limiter.store.client()
        changed = limiter.layout.prefix.encode() + b":{*}#c"  # a's own keys: on the cluster others' live beside them
        assert [k async for k in client.scan_iter(match=changed)] == []  # drained: Redis forgot the change
        for name in "bc":
            assert await h.sim.cells(name) == {}
        await h.sim.restart_agent("a")  # the agent's memory is gone; its outboxes are in Redis
        assert h.sim.regions["a"].engine is not engine
        h.sim.network.rejoin("a")
        await h.converge(rounds_bound=10, heal=False)
        for name in "abc":
            for rule in ("fine", "coarse"):
                assert (await h.sim.regions[name].limiter.usage(rule, SUBJECT)).by_region == {"a": 7}, name


async def test_hits_before_the_first_round_replicate_through_the_initial_anti_entropy(sim_redis: str) -> None:
    schedule = Schedule(steps=(), shards=64)
    async with cluster_for(schedule, sim_redis) as sim:
        h = Harness(sim, schedule)
        await h.hit("b", SUBJECT, ["coarse"], 9)  # no agent lease yet: the change is not recorded
        await h.converge(rounds_bound=5, heal=False)
        assert {n: (await sim.regions[n].limiter.usage("coarse", SUBJECT)).total for n in "abc"} == dict.fromkeys("abc", 9)


async def test_a_wipe_loses_exactly_the_hits_that_no_peer_had_received(sim_store_url: str) -> None:
    """Why the property tests only wipe a region whose cells are held elsewhere.

    Hits that no peer had received existed only in the wiped Redis (their outbox
    entries too) and are gone for good; what the peers hold comes back.
    """
    async with harness(sim_store_url) as h:
        await h.hit("a", SUBJECT, ["coarse"], 2)
        await h.sim.advance(0.5)  # replicated
        h.sim.network.isolate("a")
        before = dict(h.truth)
        await h.hit("a", SUBJECT, ["coarse"], 5)
        (queued,) = [k for k, v in h.truth.items() if v != before.get(k, 0)]
        await h.sim.advance(0.5)  # queued in a's outboxes (in a's Redis), undeliverable
        await h.sim.hit("a", "coarse", SUBJECT, 3)  # only a's Redis holds these
        assert [count_of(c[4]) for c in await h.missing_elsewhere("a")] == [10]
        await h.sim.wipe("a")
        h.truth[queued] -= 5  # the 5 queued (and the 3 new) are gone with the wipe
        await h.check_safety()
        h.sim.network.rejoin("a")
        await h.converge(rounds_bound=10, heal=False)
        for name in "abc":
            assert (await h.sim.regions[name].limiter.usage("coarse", SUBJECT)).by_region == {"a": 2}, name


async def test_a_wipe_during_a_running_anti_entropy_is_still_repaired_at_once(sim_redis: str) -> None:
    async with harness(sim_redis, regions=2, latency=0.15) as h:  # an exchange takes 0.3 s: 3 rounds
        await h.hit("a", SUBJECT, ["coarse"], 5)
        await h.sim.advance(1.0)
        assert await h.missing_elsewhere("a") == []  # b holds a's cells: a wipe loses nothing
        await h.sim.restart_agent("a")  # any anti-entropy will do; a fresh agent starts one at once
        engine = h.sim.regions["a"].engine
        while not engine.peers["b"].ae_running:
            await h.sim.advance(0.01)
        await h.sim.wipe("a")  # while that anti-entropy is in flight
        await h.sim.advance(INTERVAL)
        assert engine.stats["wipes"] == 1  # detected ...
        assert engine.peers["b"].ae_needed  # ... and a repair is due
        # The repair the wipe asked for outlives the end of the exchange that was in flight.
        await h.converge(rounds_bound=30, heal=False)

"""Three real regions (redis-server + aiohttp agent each) replicating on loopback."""

from __future__ import annotations

from collections.abc import Callable

from geolimit import Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions, eventually

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)


async def test_counts_converge_within_two_gossip_rounds(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()  # first round: leases and the initial anti-entropy
        a, b = rs["a"].app(), rs["b"].app()
        for _ in range(600):
            assert a.hit("api", "user:42").allowed
        for _ in range(400):
            assert b.hit("api", "user:42").allowed
        await rs.step(rounds=2)
        for name in "abc":
            usage = rs[name].app().usage("api", "user:42")
            assert usage.total == 1000, name
            assert usage.by_region == {"a": 600, "b": 400}, name
            assert not rs[name].app().hit("api", "user:42").allowed, f"{name} must deny the next hit"


async def test_one_round_is_enough_on_a_healthy_mesh(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()
        rs["a"].app().hit("api", "k", cost=7)
        await rs["a"].agent.step()  # only a gossips
        assert rs["b"].app().usage("api", "k").total == 7
        assert rs["c"].app().usage("api", "k").total == 7


async def test_background_loops_converge_and_report_status(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], interval=0.05) as rs:
        await eventually(lambda: all(r.agent.readiness()[0] for r in rs.regions.values()), what="readiness")
        a = rs["a"].app()
        for _ in range(300):
            a.hit("api", "u")
        took = await eventually(lambda: rs["c"].app().usage("api", "u").total == 300, what="convergence")
        assert took < 5.0
        status = rs["a"].agent.status()
        assert status["region"] == "a"
        assert status["ready"]
        assert set(status["peers"]) == {"b", "c"}
        assert status["peers"]["b"]["last_contact_age"] < 5
        # Hits keep flowing in rounds: the outbox empties once b has acknowledged them all.
        await eventually(lambda: rs["a"].agent.status()["peers"]["b"]["outbox"] == 0, what="a's outbox to b to drain")
        assert rs["b"].app().usage("api", "u").total == 300


async def test_partial_partition_converges_through_the_third_region(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()
        rs.cut("a", "b")
        rs["a"].app().hit("api", "k", cost=5)
        rs["b"].app().hit("api", "k", cost=3)
        await rs.step(rounds=15)  # 1.5 s: c learns that b and a cannot deliver and repairs them
        for name in "abc":
            assert rs[name].app().usage("api", "k").by_region == {"a": 5, "b": 3}, name
        rs["a"].app().hit("api", "k", cost=2)  # now c relays as soon as it merges
        rs["b"].app().hit("api", "k", cost=1)
        await rs.step(rounds=2)
        for name in "abc":
            assert rs[name].app().usage("api", "k").by_region == {"a": 7, "b": 4}, name
        assert rs["c"].agent.engine.stats["relayed"] > 0  # type: ignore[union-attr]


async def test_a_wiped_redis_loses_no_counts(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()
        rs["a"].app().hit("api", "k", cost=10)
        rs["b"].app().hit("api", "k", cost=20)
        await rs.step()
        rs["a"].client().flushall()  # a's Redis loses everything mid-window
        rs["a"].app().hit("api", "k", cost=4)  # new hits start a new incarnation
        await rs.step(rounds=3)
        for name in "abc":
            usage = rs[name].app().usage("api", "k")
            assert usage.total == 34, (name, usage.by_slot)
            assert usage.by_region == {"a": 14, "b": 20}, name
            assert len([s for s in usage.by_slot if s.startswith("a/")]) == 2, "old and new incarnation"
        assert rs["a"].agent.engine.stats["wipes"] == 1  # type: ignore[union-attr]


async def test_a_reset_during_concurrent_hits_converges_everywhere(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()
        for name in "abc":
            rs[name].app().hit("api", "k", cost=10)
        await rs.step()
        rs["a"].app().reset("api", "k")  # a forgets the 30 it has seen...
        rs["c"].app().hit("api", "k", cost=5)  # ...while c hits, unseen by a
        await rs.step(rounds=3)
        states = []
        for name in "abc":
            usage = rs[name].app().usage("api", "k")
            assert usage.total == 5, (name, usage.by_slot)
            live = await rs[name].agent.engine.store.read_live(await rs[name].agent.limiter.redis_time_us())  # type: ignore[union-attr]
            states.append({(k, tuple(sorted(v))) for k, v in live.items()})
        assert states[0] == states[1] == states[2], "every region holds the same cells"


async def test_a_killed_agent_resumes_without_loss_or_double_counting(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        await rs.step()
        rs["a"].app().hit("api", "k", cost=6)
        await rs.step()
        rs["a"].app().hit("api", "k", cost=9)
        await rs["a"].agent.engine.round()  # type: ignore[union-attr]  # drained, sends in flight...
        await rs["a"].agent.abort()  # ...killed before any acknowledgement
        assert rs["b"].app().usage("api", "k").total in (6, 15)
        await rs.restart_agent("a")
        await rs.step(rounds=2)
        for name in "abc":
            assert rs[name].app().usage("api", "k").total == 15, name
        rs["a"].app().hit("api", "k", cost=1)
        await rs.step()
        assert rs["b"].app().usage("api", "k").total == 16


async def test_apps_see_remote_hits_without_talking_to_an_agent(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b"], [Rule("api", 5, 60, predict=False)], run_loops=False) as rs:
        await rs.step()
        app_a, app_b = rs["a"].app(), rs["b"].app()
        for _ in range(3):
            assert app_a.hit("api", "user:1").allowed
        await rs.step()
        assert app_b.hit("api", "user:1").remaining == 1
        assert app_b.hit("api", "user:1").allowed
        assert not app_b.hit("api", "user:1").allowed

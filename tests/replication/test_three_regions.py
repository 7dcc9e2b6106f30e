"""Three real regions (a Redis + an aiohttp agent each) replicating on loopback.

Every test runs twice: on three plain redis-servers, and with region "a" on the
real 3-master Redis Cluster fixture (the cluster client's script calls and the
whole-window SCAN of ``read_live`` on every master).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
import redis.cluster

from geolimit import ManualClock, Rule
from geolimit.replication.gossip import GossipEngine
from geolimit.server.agent import Agent
from geolimit.store.embedded import EmbeddedRedis
from tests.support.mesh import Mesh, Site
from tests.support.regions import eventually

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)
LAYOUTS = ["plain", pytest.param("a-on-the-cluster", marks=pytest.mark.cluster)]


@pytest.fixture(scope="module")
def servers(redis_server_factory: Factory) -> tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedRedis]:
    return redis_server_factory(), redis_server_factory(), redis_server_factory()


@pytest.fixture(params=LAYOUTS)
def sites(request: pytest.FixtureRequest, servers: tuple[EmbeddedRedis, ...]) -> dict[str, Site]:
    """Region -> where it keeps its keys, every store flushed."""
    for server in servers:
        client = redis.Redis.from_url(server.url)
        client.flushall()
        client.close()
    a = servers[0].url
    if request.param == "a-on-the-cluster":
        request.getfixturevalue("cluster_client")  # flushes every master
        a = str(request.getfixturevalue("redis_cluster_url"))
    return {"a": Site(a), "b": Site(servers[1].url), "c": Site(servers[2].url)}


def stepped(sites: dict[str, Site], rules: list[Rule] | None = None) -> Mesh:
    """Agents without their loops: the test runs the gossip rounds (and moves the clock)."""
    return Mesh(sites, rules or [API], run_loops=False, clock=ManualClock(time.time()))


def engine_of(agent: Agent) -> GossipEngine:
    assert agent.engine is not None
    return agent.engine


async def test_counts_converge_within_two_gossip_rounds(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()  # first round: leases and the initial anti-entropy
        a, b = mesh["a"].app, mesh["b"].app
        for _ in range(600):
            assert (await a.hit("api", "user:42")).allowed
        for _ in range(400):
            assert (await b.hit("api", "user:42")).allowed
        await mesh.step(rounds=2)
        for name in "abc":
            usage = await mesh[name].usage("api", "user:42")
            assert usage.total == 1000, name
            assert usage.by_region == {"a": 600, "b": 400}, name
            assert not (await mesh[name].app.hit("api", "user:42")).allowed, f"{name} must deny the next hit"


async def test_one_round_is_enough_on_a_healthy_mesh(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()
        await mesh["a"].app.hit("api", "k", cost=7)
        await mesh["a"].agent.step()  # only a gossips
        assert (await mesh["b"].usage("api", "k")).total == 7
        assert (await mesh["c"].usage("api", "k")).total == 7


async def test_background_loops_converge_while_hits_keep_coming(sites: dict[str, Site]) -> None:
    async with Mesh(sites, [API], interval=0.05) as mesh:
        await eventually(mesh.ready, timeout=30, what="every agent ready")
        a = mesh["a"].app
        stats = engine_of(mesh["a"].agent).stats
        for _ in range(6):  # bursts of hits interleave with a's gossip rounds on the same event loop
            for _ in range(50):
                assert (await a.hit("api", "u")).allowed
            mark = stats["rounds"]
            await eventually(lambda mark=mark: stats["rounds"] > mark, timeout=30,
                             what="a gossip round after a burst of hits")

        async def everywhere() -> bool:
            return [(await mesh[n].usage("api", "u")).total for n in "bc"] == [300, 300]

        await eventually(everywhere, timeout=30, what="the 300 hits counted in b and c")
        status = mesh["a"].agent.status()
        assert (status["region"], status["ready"]) == ("a", True)
        assert set(status["peers"]) == {"b", "c"}
        assert status["peers"]["b"]["last_contact"] is not None
        await eventually(lambda: mesh["a"].agent.status()["peers"]["b"]["outbox"] == 0, timeout=30,
                         what="a's outbox to b to drain once b acknowledged every hit")
        assert (await mesh["b"].usage("api", "u")).total == 300


async def test_partial_partition_converges_through_the_third_region(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()
        mesh.cut("a", "b")
        await mesh["a"].app.hit("api", "k", cost=5)
        await mesh["b"].app.hit("api", "k", cost=3)
        await mesh.step(rounds=15)  # 1.5 s: c learns that b and a cannot deliver and repairs them
        for name in "abc":
            assert (await mesh[name].usage("api", "k")).by_region == {"a": 5, "b": 3}, name
        await mesh["a"].app.hit("api", "k", cost=2)  # now c relays as soon as it merges
        await mesh["b"].app.hit("api", "k", cost=1)
        await mesh.step(rounds=2)
        for name in "abc":
            assert (await mesh[name].usage("api", "k")).by_region == {"a": 7, "b": 4}, name
        assert engine_of(mesh["c"].agent).stats["relayed"] > 0


async def test_a_wiped_redis_loses_no_counts(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()
        await mesh["a"].app.hit("api", "k", cost=10)
        await mesh["b"].app.hit("api", "k", cost=20)
        await mesh.step()
        assert mesh["a"].site.wipe() > 0  # a's Redis loses everything mid-window
        await mesh["a"].app.hit("api", "k", cost=4)  # new hits start a new incarnation
        await mesh.step(rounds=3)
        for name in "abc":
            usage = await mesh[name].usage("api", "k")
            assert usage.total == 34, (name, usage.by_slot)
            assert usage.by_region == {"a": 14, "b": 20}, name
            assert len([s for s in usage.by_slot if s.startswith("a/")]) == 2, "old and new incarnation"
        assert engine_of(mesh["a"].agent).stats["wipes"] == 1


async def test_a_reset_during_concurrent_hits_converges_everywhere(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()
        for name in "abc":
            await mesh[name].app.hit("api", "k", cost=10)
        await mesh.step()
        await mesh["a"].app.reset("api", "k")  # a forgets the 30 it has seen...
        await mesh["c"].app.hit("api", "k", cost=5)  # ...while c hits, unseen by a
        await mesh.step(rounds=3)
        states = []
        for name in "abc":
            usage = await mesh[name].usage("api", "k")
            assert usage.total == 5, (name, usage.by_slot)
            agent = mesh[name].agent
            assert agent.engine is not None
            assert agent.limiter is not None
            live = await agent.engine.store.read_live(await agent.limiter.redis_time_us())
            assert set(live) == {("api", b"k")}, name
            states.append({(k, tuple(sorted(v))) for k, v in live.items()})
        assert states[0] == states[1] == states[2], "every region holds the same cells"


async def test_a_killed_agent_resumes_without_loss_or_double_counting(sites: dict[str, Site]) -> None:
    async with stepped(sites) as mesh:
        await mesh.step()
        await mesh["a"].app.hit("api", "k", cost=6)
        await mesh.step()
        await mesh["a"].app.hit("api", "k", cost=9)
        await engine_of(mesh["a"].agent).round()  # drained, sends in flight...
        await mesh["a"].agent.abort()  # ...killed before any acknowledgement
        assert (await mesh["b"].usage("api", "k")).total in (6, 15)
        await mesh.restart_agent("a")
        await mesh.step(rounds=2)
        for name in "abc":
            assert (await mesh[name].usage("api", "k")).total == 15, name
        await mesh["a"].app.hit("api", "k", cost=1)
        await mesh.step()
        assert (await mesh["b"].usage("api", "k")).total == 16


async def test_apps_see_remote_hits_without_talking_to_an_agent(sites: dict[str, Site]) -> None:
    async with stepped(sites, [Rule("api", 5, 60, predict=False)]) as mesh:
        await mesh.step()
        app_a, app_b = mesh["a"].app, mesh["b"].app
        for _ in range(3):
            assert (await app_a.hit("api", "user:1")).allowed
        await mesh.step()
        assert (await app_b.hit("api", "user:1")).remaining == 1
        assert (await app_b.hit("api", "user:1")).allowed
        assert not (await app_b.hit("api", "user:1")).allowed

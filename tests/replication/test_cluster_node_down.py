"""A Redis Cluster node down stops only its own shards' gossip.

Region a runs on a real 3-node Redis Cluster (``cluster-require-full-coverage
no``, so the surviving masters keep serving their slots); region b on a single
redis-server. While one of a's masters is dead, a's admissions on the other
masters' shards must still reach b; once it is back, its shards catch up.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
import redis.cluster

from geolimit import Rule
from geolimit.core.keys import KeyLayout
from geolimit.errors import StorageError
from geolimit.store.embedded import EmbeddedRedis
from geolimit.store.embedded.cluster import EmbeddedRedisCluster
from tests.support.regions import Regions, eventually

pytestmark = pytest.mark.cluster

API = Rule("api", 1_000_000, 60, 1)


class _ClusterSite:
    """What Regions needs of a region's Redis: its URL."""

    def __init__(self, cluster: EmbeddedRedisCluster) -> None:
        self.url = cluster.url


@pytest.fixture
def cluster() -> Iterator[EmbeddedRedisCluster]:
    with EmbeddedRedisCluster(3, extra_args=["--cluster-require-full-coverage", "no"]) as running:
        yield running


async def test_a_dead_node_stops_only_its_shards_gossip(
    cluster: EmbeddedRedisCluster, redis_server_factory: Callable[..., EmbeddedRedis]
) -> None:
    sites: list[Any] = [_ClusterSite(cluster)]

    def factory(**kw: Any) -> Any:
        return sites.pop() if sites else redis_server_factory(**kw)

    layout = KeyLayout()
    client = redis.cluster.RedisCluster.from_url(cluster.url.replace("redis+cluster", "redis"))
    victim = cluster.nodes[1]
    subjects = [f"user:{i}" for i in range(90)]
    on_victim = {s for s in subjects if client.get_node_from_key(layout.data_key("api", s.encode())).port == victim.port}
    client.close()
    live = [s for s in subjects if s not in on_victim]
    assert on_victim
    assert live

    async with Regions(factory, ["a", "b"], [API], interval=0.1) as rs, aiohttp.ClientSession() as http:
        a_app, b_app = rs["a"].app(), rs["b"].app()

        def b_sees(names: list[str], count: int) -> bool:
            return all(b_app.usage("api", s).by_region.get("a", 0) == count for s in names)

        for s in subjects:
            a_app.hit("api", s)
        await eventually(lambda: b_sees(subjects, 1), 10, "b sees a's first hits")

        os.kill(victim.pid, signal.SIGKILL)
        for s in live:
            a_app.hit("api", s)
        await eventually(lambda: b_sees(live, 2), 15, "b sees a's hits on the live nodes' shards while one node is down")

        async def unreachable() -> list[int]:
            async with http.get(rs["a"].agent.api_url + "/v1/status") as reply:
                return list((await reply.json())["shards_unreachable"])

        assert await unreachable(), "the status names the shards of the dead node"
        async with http.get(rs["a"].agent.api_url + "/readyz") as reply:
            # The live nodes' subjects are still decided: the agent stays in its load balancer.
            assert reply.status == 200, await reply.text()
        async with http.get(rs["a"].agent.api_url + "/metrics") as reply:
            assert "geolimit_shards_unreachable" in await reply.text()

        victim.restart()  # empty: a's first hits there come back from b by anti-entropy
        await eventually(lambda: _answers(a_app, sorted(on_victim)), 20, "the node's shards answer again")
        for s in on_victim:
            a_app.hit("api", s)
        await eventually(lambda: b_sees(sorted(on_victim), 2), 20, "b sees the hits on the restarted node's shards")
        await eventually(lambda: _empty(unreachable()), 20, "every shard reachable again")


def _answers(app: Any, names: list[str]) -> bool:
    """Every subject's shard answers (a peek counts nothing)."""
    try:
        for s in names:
            app.peek("api", s)
    except StorageError:
        return False
    return True


async def _empty(shards: Any) -> bool:
    return not await shards

"""The outbox figure an operator watches (``/v1/status`` ``outbox``, the
``geolimit_outbox_cells`` gauge): while a peer is down it holds still, even in the
middle of a round that packs the outbox into flight and gets it back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from geolimit import ManualClock, Rule
from geolimit.replication.store_results import Packed
from geolimit.store.embedded import EmbeddedRedis
from tests.support.mesh import Mesh, Site

API = Rule("api", 1000, 10, 1)


async def test_the_outbox_of_a_down_peer_never_dips_during_a_round(
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    servers = {name: redis_server_factory() for name in "ab"}
    for server in servers.values():
        redis.Redis.from_url(server.url).flushall()
    sites = {name: Site(server.url) for name, server in servers.items()}
    async with Mesh(sites, [API], run_loops=False, clock=ManualClock(time.time()), shards=32) as mesh:
        await mesh.step()
        mesh.cut("a", "b")
        subjects = [f"user:{i}" for i in range(300)]  # every shard: several pack calls per message
        for subject in subjects:
            assert (await mesh["a"].app.hit("api", subject)).allowed
        agent = mesh["a"].agent
        engine = agent.engine
        assert engine is not None
        peer = engine.peers["b"]
        store = engine.store
        seen: list[int] = []
        pack = store.pack

        async def watched_pack(*args: Any, **kwargs: Any) -> Packed:
            seen.append(peer.queued)
            got = await pack(*args, **kwargs)
            seen.append(peer.queued)
            return got

        store.pack = watched_pack  # type: ignore[method-assign]
        for _ in range(3):  # the drain, then rounds that fail against the cut link
            await agent.step()
        assert len(seen) >= 4, "the rounds packed the outbox in several calls"
        assert peer.failures > 0
        assert set(seen) == {len(subjects)}, seen
        assert peer.queued == len(subjects)

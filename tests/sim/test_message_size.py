"""A slow peer gets smaller messages, and a quick one gets them back to full size."""

from __future__ import annotations

from geolimit import Rule
from geolimit.sim import SimCluster

RULE = Rule("api", 10**6, 60, 1)


async def test_messages_shrink_for_a_slow_peer_and_grow_back_when_it_is_quick(sim_redis: str) -> None:
    settings = {"max_cells_per_message": 1600, "probe_cells": 100, "send_timeout": 0.2, "window": 1}
    async with SimCluster(sim_redis, ["a", "b"], [RULE], latency=0.06, settings=settings) as sim:
        await sim.advance(0.5)
        a = sim.regions["a"]
        peer = a.engine.peers["b"]
        for i in range(4000):
            await a.limiter.hit("api", f"user:{i}")
        # Each round trip takes 0.12 s, over half the 0.2 s timeout: messages get smaller,
        # and none ever fails.
        await sim.advance(3.0)
        assert 100 <= peer.message_cells < 1600
        assert peer.errors == 0
        assert (await sim.regions["b"].limiter.usage("api", "user:3999")).total == 1
        sim.network.latency = 0.005  # now quick: back to the full size
        for i in range(4000, 12000):
            await a.limiter.hit("api", f"user:{i}")
        await sim.advance(3.0)
        assert peer.message_cells == 0  # the maximum again
        assert (await sim.regions["b"].limiter.usage("api", "user:11999")).total == 1

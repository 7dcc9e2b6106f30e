"""A slow peer gets smaller messages, and a quick one gets them back to full size."""

from __future__ import annotations

from typing import Any

import msgpack

from geolimit import Rule
from geolimit.replication import wire
from geolimit.replication.peers import PeerState
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


def test_a_burst_ramps_up_from_an_eighth_of_the_message_limit() -> None:
    peer = PeerState("b")
    peer.start_ramp(10_000)
    caps = [peer.ramp_limit(10_000) for _ in range(9)]
    assert caps == [1250, 1875, 2813, 4220, 6330, 9495, 10_000, 10_000, 10_000]
    peer.start_ramp(10_000)  # the next burst starts small again
    assert peer.ramp_limit(10_000) == 1250
    assert peer.ramp_limit(500) == 500  # a slow peer's smaller limit still caps it


async def test_a_burst_reaches_the_peer_in_growing_messages_and_whole(sim_redis: str) -> None:
    settings = {"max_cells_per_message": 1600, "window": 1}
    async with SimCluster(sim_redis, ["a", "b"], [RULE], latency=0.005, settings=settings) as sim:
        await sim.advance(0.5)
        receiver: Any = sim.network.receivers["b"]
        sizes: list[int] = []
        receive = receiver.receive

        async def counting(message: wire.Message) -> wire.Message:
            cells = sum(sum(msgpack.unpackb(blob)[2]) for _, blob in message.blobs)
            if cells:
                sizes.append(cells)
            reply: wire.Message = await receive(message)
            return reply

        receiver.receive = counting
        a = sim.regions["a"]
        for i in range(6000):
            await a.limiter.hit("api", f"user:{i}")
        await sim.advance(2.0)
        # The peer could start merging after a short pack: 200 cells, then half as many again
        # each time, up to the limit.
        assert sizes[:5] == [200, 300, 450, 675, 1013]
        assert max(sizes) == 1600
        assert sum(sizes) == 6000
        for i in (0, 2999, 5999):
            assert (await sim.regions["b"].limiter.usage("api", f"user:{i}")).total == 1

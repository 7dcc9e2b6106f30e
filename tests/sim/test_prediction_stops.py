"""Region b is not denied for region a's past burst once a's next update arrives.

Real Lua and the real gossip engine on a virtual clock (geolimit.sim). Prediction
reserves for a peer's rate from its last update that raised the key; an update
of that peer that shows its counts current past that rise (here a heartbeat,
with nothing in it) says it stopped, and the reserve is gone.
"""

from __future__ import annotations

from geolimit import Rule
from geolimit.sim import SimCluster

RULE = Rule("api", 100, 60, 6)  # predict (the default), partition "local", partition_after 1 s


async def test_b_admits_the_rest_of_the_limit_once_a_burst_peer_is_heard_again(sim_redis: str) -> None:
    async with SimCluster(sim_redis, ["a", "b"], [RULE]) as sim:
        await sim.advance(2.0)  # the regions hear from each other
        for _ in range(60):
            assert (await sim.hit("a", "api", "user:1")).allowed
        b = sim.regions["b"].limiter
        for _ in range(40):  # until b has merged a's burst (one delta, ~0.15 s)
            if (await b.usage("api", "user:1")).by_region.get("a") == 60:
                break
            await sim.advance(0.01)
        seen = await b.usage("api", "user:1")
        assert seen.by_region == {"a": 60}
        assert seen.bad == 0, "the rise field merge.lua keeps for prediction is no stored count"
        early = await b.peek("api", "user:1", 40)
        assert not early.allowed, "while a may still be admitting, b reserves for its rate"
        await sim.advance(1.5)  # a's next update (a heartbeat: nothing rose) reaches b
        admitted = 0
        for _ in range(45):
            if (await sim.hit("b", "api", "user:1")).allowed:
                admitted += 1
            await sim.advance(0.001)
        assert admitted == 40, "b gets every unit a left, and no more"

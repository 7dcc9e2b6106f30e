"""The agreed region clock: regions whose clocks disagree still count the same buckets.

The simulator (real Redis and Lua, the real gossip engine, virtual time) with clocks
1 s apart: once the engines have measured each other, every region's decisions run
on the mean of the clocks, so a hit in a region whose clock runs behind no longer
leaves the others' windows early. Run on a plain redis-server and on the cluster.
"""

from __future__ import annotations

import pytest

from geolimit.core.rule import Rule
from geolimit.sim.cluster import SimCluster

SKEW = {"a": 0.0, "b": 1.0, "c": -1.0}  # b runs 1 s ahead, c 1 s behind; the mean is a's clock
RULE = Rule("api", 10, 10, 1)  # 10 per 10 s, 1 s buckets


async def _at_fraction(sim: SimCluster, fraction: float) -> float:
    """Advance to ``fraction`` of the way through the next second of the true clock; return that time."""
    now = sim.clock.now_us() / 1e6
    target = int(now) + 1 + fraction
    await sim.advance(target - now)
    return target


async def _skewed(url: str, skew: dict[str, float]) -> SimCluster:
    return SimCluster(url, list(skew), [RULE], interval=0.1, latency=0.05, skew=skew, shards=4)


async def test_every_region_agrees_on_one_clock_within_a_few_rounds(sim_store_url: str) -> None:
    async with await _skewed(sim_store_url, SKEW) as sim:
        await sim.advance(2.0)
        corrections = {n: r.engine.clock_correction for n, r in sim.regions.items()}
        assert corrections == pytest.approx({"a": 0.0, "b": -1.0, "c": 1.0}, abs=0.01)
        agreed = {n: r.engine.region_clock() for n, r in sim.regions.items()}
        assert max(agreed.values()) - min(agreed.values()) < 0.01


async def test_a_region_behind_does_not_let_its_hits_leave_the_window_early(sim_store_url: str) -> None:
    async with await _skewed(sim_store_url, SKEW) as sim:
        await sim.advance(2.0)  # offsets measured, corrections stored in the registries
        start = await _at_fraction(sim, 0.9)  # late in a bucket of the true (and agreed) clock
        for _ in range(10):
            assert (await sim.hit("c", "api", "user:1")).allowed
        await sim.advance(1.0)  # replicated everywhere
        assert (await sim.views("api", "user:1")) == {n: {"c": 10} for n in "abc"}
        # 9.3 s after c's hits, a true 10 s window still holds all 10 of them. Without the
        # agreed clock c (1 s behind) wrote them into the bucket before, which left a's
        # and b's windows at 9.1 s, and both admitted 10 more.
        await sim.advance(start + 9.3 - sim.clock.now_us() / 1e6)
        for name in "ab":
            decision = await sim.hit(name, "api", "user:1")
            assert not decision.allowed, name
            assert decision.retry_after == pytest.approx(0.8, abs=0.01)  # when the agreed bucket leaves


async def test_usage_reads_the_same_buckets_as_decisions(sim_store_url: str) -> None:
    async with await _skewed(sim_store_url, {"a": 0.0, "b": 2.0}) as sim:
        await sim.advance(2.0)
        assert sim.regions["b"].engine.clock_correction == pytest.approx(-1.0, abs=0.01)
        await _at_fraction(sim, 0.5)
        assert (await sim.hit("b", "api", "user:2")).allowed
        await sim.advance(9.2)  # b's raw clock is 10.2 s on: past the window, not on the agreed clock
        usage = await sim.regions["b"].limiter.usage("api", "user:2")
        assert usage.total == 1
        decision = await sim.hit("b", "api", "user:2")
        assert decision.remaining == 8  # the earlier hit still counts, and this one

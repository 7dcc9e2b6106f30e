"""Escrow mode between simulated regions (pure model, virtual time, 50 ms links, 100 ms gossip):
rights travel to where the traffic is, a partitioned region keeps exactly its rights,
bursts at every region at once admit at most the limit, and a limit change scales the rights."""

from __future__ import annotations

import random

import pytest

from geolimit.sim.escrow import EscrowCluster
from geolimit.sim.oracle import Request, measure

SUBJECT = b"user:42"
INTERVAL, LATENCY = 0.1, 0.05
#: A region's demand reaches a giver within one round plus a one-way trip, the
#: giver gives at its next round, and the rights take another one-way trip.
TRAVEL = 2 * INTERVAL + 2 * LATENCY


def cluster(limit: int, window: float = 60.0, resolution: float = 6.0, **options: object) -> EscrowCluster:
    sim = EscrowCluster(["a", "b", "c"], limit, window, resolution, interval=INTERVAL, latency=LATENCY,
                        **options)  # type: ignore[arg-type]
    sim.start()
    return sim


class Log:
    """Every decision, for the exact oracle."""

    def __init__(self, sim: EscrowCluster) -> None:
        self.sim = sim
        self.requests: list[Request] = []
        self.start_us = sim.clock.now_us()

    def hit(self, region: str, cost: int = 1) -> bool:
        allowed = self.sim.hit(region, SUBJECT, cost).allowed
        self.requests.append(Request(self.sim.clock.now_us(), region, cost, allowed))
        return allowed

    def max_over(self, limit: int) -> int:
        sim = self.sim
        return measure(self.requests, limit, sim.window_us, self.start_us, sim.clock.now_us()).max_over


@pytest.mark.parametrize("phase", [0.0, 0.013, 0.05, 0.087])
async def test_a_busy_region_gets_the_idle_regions_spare_within_two_rounds(phase: float) -> None:
    sim = cluster(1000)
    await sim.advance(0.3 + phase)
    began = sim.now
    assert sim.hit("a", SUBJECT).allowed
    assert sim.rights("a", SUBJECT) == 334
    while sim.rights("a", SUBJECT) < 1000:
        assert sim.now - began <= TRAVEL, f"a holds {sim.rights('a', SUBJECT)} after {sim.now - began:.3f} s"
        await sim.advance(0.001)
    assert (sim.rights("b", SUBJECT), sim.rights("c", SUBJECT)) == (0, 0)
    # The rights are a's now: it admits the whole limit at once, with no gossip in between.
    sim.gossip = False
    assert sum(sim.hit("a", SUBJECT).allowed for _ in range(1000)) == 999


async def test_a_partitioned_region_keeps_exactly_its_rights() -> None:
    sim = cluster(300, window=10.0, resolution=1.0)
    log = Log(sim)
    rng = random.Random(3)
    await sim.advance(0.5)
    sim.network.isolate("c")
    held = sim.rights("c", SUBJECT)
    assert held == 100
    for _ in range(200):  # 20 s of traffic at 3x the limit in a and b, a little in c
        for _ in range(rng.randint(4, 14)):
            log.hit(rng.choice("ab"))
        if rng.random() < 0.3:
            log.hit("c")
        await sim.advance(0.1)
        assert sim.rights("c", SUBJECT) == held
        assert sim.used("c", SUBJECT) <= held
    # a and b shared what they held between them and never reached into c's rights.
    assert sim.rights("a", SUBJECT) + sim.rights("b", SUBJECT) == 300 - held
    assert log.max_over(300) == 0
    sim.network.rejoin("c")
    await sim.advance(1.0)  # c's spare (it had little traffic) goes where the demand is
    assert sim.rights("c", SUBJECT) < held
    await sim.advance(3.0)  # the demand has died down: every region holds the same transfers
    assert sim.agree()


@pytest.mark.parametrize("limit", [5, 100])
@pytest.mark.parametrize("spacing", [0.0, 0.001, 0.05])
async def test_bursts_fired_at_every_region_at_once_admit_at_most_the_limit(limit: int, spacing: float) -> None:
    for seed in range(3):
        sim = cluster(limit, jitter=0.02, seed=seed)
        log = Log(sim)
        await sim.advance(0.2 + 0.03 * seed)
        for _ in range(limit):  # 3x the limit: one request per region each time
            for region in ("a", "b", "c"):
                log.hit(region)
            await sim.advance(spacing)
        admitted = sum(r.allowed for r in log.requests)
        assert admitted <= limit
        if spacing:
            assert admitted == limit  # nothing else used the window: all of the limit went out


async def test_skewed_clocks_never_over_admit() -> None:
    sim = cluster(300, window=10.0, resolution=1.0, skew={"a": 0.0, "b": 1.0, "c": -1.0})
    log = Log(sim)
    rng = random.Random(5)
    for _ in range(300):
        for _ in range(rng.randint(0, 18)):
            log.hit(rng.choice("abc"))
        await sim.advance(0.1)
    assert log.max_over(300) == 0
    assert sum(r.allowed for r in log.requests) > 2 * 300  # rights kept moving: ~3 windows' worth went out


async def test_a_limit_change_scales_the_rights_and_a_region_over_its_new_rights_waits() -> None:
    sim = cluster(30)
    log = Log(sim)
    assert log.hit("a")
    await sim.advance(1.0)
    for _ in range(11):
        assert log.hit("a")
    assert [sim.rights(n, SUBJECT) for n in "abc"] == [30, 0, 0]  # b and c gave their spare to a
    sim.set_limit("a", 60)  # a reloads first: its rights scale; b and c still hold theirs under 30
    assert [sim.rights(n, SUBJECT) for n in "abc"] == [60, 0, 0]
    for name in "bc":
        sim.set_limit(name, 60)
    for name in "abc":
        sim.set_limit(name, 6)  # a holds 11 admissions in the window: more than its 6 new rights
    assert [sim.rights(n, SUBJECT) for n in "abc"] == [6, 0, 0]
    changed, since = sim.now, len(log.requests)
    allowed_at: list[float] = []
    for _ in range(90):  # a asks once a second: denied until its own admissions leave the window
        await sim.advance(1.0)
        if log.hit("a"):
            allowed_at.append(sim.now - changed)
    # The last of the 11 was admitted as the limit changed: 60 s later the window has passed it.
    assert allowed_at == [61.0, 62.0, 63.0, 64.0, 65.0, 66.0]
    assert [sim.rights(n, SUBJECT) for n in "abc"] == [6, 0, 0]  # the traffic is in a: it keeps the rights
    after = Log(sim)
    after.requests, after.start_us = log.requests[since:], round(changed * 1e6)
    assert after.max_over(6) == 0
    assert log.max_over(30) == 0

"""Escrow mode between three real regions (a Redis and an aiohttp agent each), in manual time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import pytest

from geolimit import Limiter, Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
OTP = Rule("otp", 5, 60, escrow=True)
LOGIN = Rule("login", 100, 60, escrow=True)
NAMES = ["a", "b", "c"]


async def ready(rs: Regions) -> None:
    """Until every shard's escrow state is released: one window after the first round, with pulls done."""
    await rs.step(2)
    rs.clock.advance(OTP.window)
    await rs.step(3)


async def test_a_new_deployment_admits_once_every_peer_was_pulled_without_waiting_a_window(
    redis_server_factory: Factory, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="geolimit")
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await rs.step(1)  # the agents publish the regions
        apps = {n: rs[n].app() for n in NAMES}
        first = apps["a"].hit("login", "u")
        assert not first.allowed  # held: a new Redis
        assert first.error is not None
        assert "restored" in first.error
        await rs.step(1)
        rs.clock.advance(rs["a"].agent.config.timeout)  # pushes in flight at a loss would have landed
        await rs.step(3)
        assert LOGIN.window > rs["a"].agent.config.timeout + 1
        # No peer holds anything a, b or c wrote: nothing was lost, so no window to wait out.
        assert sum(apps[n].hit("login", "u").allowed for n in NAMES for _ in range(100)) == 100
    restored = [r.getMessage() for r in caplog.records if "restored from every peer" in r.getMessage()]
    assert len(restored) == len(NAMES)  # one line per region, not one per shard (64 each)
    assert all("64 shard(s)" in line for line in restored)


async def test_a_burst_at_all_three_regions_at_once_admits_at_most_the_limit(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, NAMES, [OTP, LOGIN], run_loops=False) as rs:
        await ready(rs)
        apps = {n: rs[n].app() for n in NAMES}
        for rule, limit in (("otp", 5), ("login", 100)):
            admitted = sum(apps[n].hit(rule, "victim").allowed for _ in range(limit) for n in NAMES)
            assert admitted <= limit
            assert admitted == limit  # no rights left unused when every region asks
            await rs.step(3)  # gossip rounds move no extra rights into being
            assert sum(apps[n].hit(rule, "victim").allowed for n in NAMES for _ in range(limit)) == 0


async def test_rights_move_to_a_busy_region_within_a_few_rounds(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await ready(rs)
        a = rs["a"].app()
        first = sum(a.hit("login", "user").allowed for _ in range(100))
        assert first == 34  # its share: 100 split over 3, the remainder to the first
        await rs.step(3)  # a's advert reaches b and c, their gifts reach a
        more = sum(a.hit("login", "user").allowed for _ in range(100))
        assert first + more >= 95
        assert first + more <= 100
        assert sum(rs[n].app().hit("login", "user").allowed for n in ("b", "c") for _ in range(100)) \
            == 100 - first - more


async def test_a_partition_never_over_admits(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await ready(rs)
        apps = {n: rs[n].app() for n in NAMES}
        rs.cut("a", "b")
        rs.cut("a", "c")
        admitted = 0
        for _ in range(5):
            admitted += sum(apps[n].hit("login", "u").allowed for n in NAMES for _ in range(30))
            await rs.step()
        assert admitted <= 100
        rs.heal("a", "b")
        rs.heal("a", "c")
        for _ in range(5):
            admitted += sum(apps[n].hit("login", "u").allowed for n in NAMES for _ in range(30))
            await rs.step()
        assert admitted <= 100


async def test_a_limit_change_scales_rights_and_a_region_over_its_new_rights_waits_one_window(
    redis_server_factory: Factory,
) -> None:
    old = Rule("pin", 30, 60, escrow=True)
    new = old.with_limit(6)
    async with Regions(redis_server_factory, NAMES, [old], run_loops=False) as rs:
        await ready(rs)
        apps = {n: rs[n].app() for n in NAMES}
        a_admitted = sum(apps["a"].hit("pin", "u").allowed for _ in range(10))
        await rs.step(3)  # b and c give a part of their spare to busy a
        a_admitted += sum(apps["a"].hit("pin", "u").allowed for _ in range(1))
        assert a_admitted == 11
        for name in NAMES:  # SIGHUP with the new limit everywhere
            region = rs[name]
            await region.agent.reload(replace(region.agent.config, rules=(new,)))
            apps[name].set_rules([new])
        after = {n: sum(apps[n].hit("pin", "u").allowed for _ in range(10)) for n in NAMES}
        assert after["a"] == 0, "a holds 11 admissions, above its new rights: it waits for them to leave"
        assert 11 + sum(after.values()) <= 30  # the largest limit in force while they overlap
        await rs.step(2)
        rs.clock.advance(new.window)
        await rs.step(3)
        burst = sum(apps[n].hit("pin", "v").allowed for n in NAMES for _ in range(6))
        assert 6 - 2 <= burst <= 6  # at most regions - 1 units lost to the floors


async def test_a_region_that_lost_its_redis_denies_until_restored_and_never_respends_given_rights(
    redis_server_factory: Factory,
) -> None:
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await ready(rs)
        apps = {n: rs[n].app() for n in NAMES}
        b_admitted = sum(apps["b"].hit("login", "u").allowed for _ in range(100))
        await rs.step(3)
        b_admitted += sum(apps["b"].hit("login", "u").allowed for _ in range(100))
        assert b_admitted >= 90  # a and c gave b their spare
        assert apps["a"].peek("login", "u").remaining < 34  # its app knows the regions (and a gave rights away)
        rs["a"].client().flushall()  # a's Redis loses everything, its transfers to b included
        lost = apps["a"].hit("login", "u")
        assert not lost.allowed
        assert lost.error is not None
        assert "restored" in lost.error
        await rs.step(2)
        assert not apps["a"].hit("login", "u").allowed  # restored from the peers, but not a window yet
        rs.clock.advance(LOGIN.window)
        await rs.step(3)
        burst = sum(apps[n].hit("login", "w").allowed for n in NAMES for _ in range(100))
        assert burst == 100
        again = sum(apps[n].hit("login", "u").allowed for n in NAMES for _ in range(100))
        assert again == 100, "b's admissions left the window; the rights a gave b stay b's"


async def lose_redis(rs: Regions, name: str, wait: float) -> None:
    """``name``'s Redis loses everything and a new agent process starts on it (nothing in
    memory either); rounds run, with ``wait`` seconds between the first two and the rest."""
    rs[name].client().flushall()
    await rs.restart_agent(name)
    await rs.step(2)
    rs.clock.advance(wait)
    await rs.step(3)


def spend_every_share(apps: dict[str, Limiter], subject: str) -> int:
    """No round runs: every region spends its share of ``subject`` (its agent hears of nothing)."""
    return sum(apps[n].hit("login", subject).allowed for n in NAMES for _ in range(40))


async def test_a_region_that_spent_while_its_agent_was_down_then_lost_its_redis_waits_a_window(
    redis_server_factory: Factory,
) -> None:
    """Admissions no peer ever heard of (the agent was down) still count after a loss."""
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await ready(rs)
        apps = {n: rs[n].app() for n in NAMES}
        assert spend_every_share(apps, "z") == 100  # a's agent is down meanwhile
        await lose_redis(rs, "a", rs["a"].agent.config.timeout)
        lost = apps["a"].hit("login", "z")
        assert not lost.allowed, "a's lost admissions of this window would be admitted twice"
        assert lost.error is not None
        assert "restored" in lost.error
        assert spend_every_share(apps, "z") == 0
        rs.clock.advance(LOGIN.window)
        await rs.step(3)
        assert spend_every_share(apps, "y") == 100


async def test_peers_that_lost_their_redis_learn_a_regions_hold_start_again(
    redis_server_factory: Factory,
) -> None:
    """b's and c's records of a's hold start go with their own wipes; a's next pulls give
    them back, so a's later loss (its agent down, nothing advertised) still waits a window."""
    async with Regions(redis_server_factory, NAMES, [LOGIN], run_loops=False) as rs:
        await ready(rs)
        for peer in ("b", "c"):
            await lose_redis(rs, peer, LOGIN.window)  # its own hold: a window, since a and the other knew it
            assert rs[peer].agent.escrow.held == 0  # type: ignore[union-attr]
        layout = rs["b"].agent.escrow.layout  # type: ignore[union-attr]
        assert all(rs[p].client().hget(layout.registry_key(s), "xk:a") is not None
                   for p in ("b", "c") for s in range(layout.shards))
        apps = {n: rs[n].app() for n in NAMES}
        assert spend_every_share(apps, "z") == 100
        await lose_redis(rs, "a", rs["a"].agent.config.timeout)
        assert spend_every_share(apps, "z") == 0

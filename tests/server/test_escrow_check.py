"""Escrow rules through the agents' /v1/check: three regions in real time, a burst at all of them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from geolimit import Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import check
from tests.support.regions import Regions, eventually

OTP = Rule("otp", 5, 2, escrow=True)


async def test_a_burst_through_v1_check_at_three_regions_admits_at_most_the_limit(
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    async with Regions(redis_server_factory, ["a", "b", "c"], [OTP], interval=0.05) as rs, \
            aiohttp.ClientSession() as session:
        agents = [rs[n].agent for n in ("a", "b", "c")]

        def released() -> bool:  # a fresh Redis holds escrow rules for one window, until restored from peers
            return all(agent.escrow is not None and agent.escrow.held == 0 for agent in agents)

        await eventually(released, timeout=30, what="escrow rules released after the first window")
        replies = await asyncio.gather(*(
            check(session, agent, {"rule": "otp", "subject": "victim"}) for agent in agents for _ in range(5)
        ))
        assert all(status in (200, 429) for status, _ in replies), replies
        assert sum(body["allowed"] for _, body in replies) == 5, replies
        denied = [body for _, body in replies if not body["allowed"]]
        assert all(0 < body["retry_after"] <= OTP.window + 1e-6 for body in denied), [b["retry_after"] for b in denied]


async def test_usage_shows_this_regions_count_and_rights_and_reset_is_refused(
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    """/v1/usage of an escrow rule: this region's own count, the peers' as advertised, and
    what this region may still admit; /v1/reset of it is a 400 naming escrow mode."""
    login = Rule("login", 30, 20, escrow=True)
    async with Regions(redis_server_factory, ["a", "b", "c"], [login, Rule("plain", 30, 20)], interval=0.05) as rs, \
            aiohttp.ClientSession() as session:
        agents = [rs[n].agent for n in ("a", "b", "c")]
        await eventually(lambda: all(a.escrow is not None and a.escrow.held == 0 for a in agents), timeout=60,
                         what="escrow rules released after the first window")
        a, b = agents[0], agents[1]
        for _ in range(4):
            _, body = await check(session, a, {"rule": "login", "subject": "u"})
            assert body["allowed"], body

        async def usage(agent: object) -> dict[str, object]:
            async with session.get(f"{agent.url}/v1/usage", params={"rule": "login", "subject": "u"}) as resp:  # type: ignore[attr-defined]
                assert resp.status == 200
                return await resp.json()  # type: ignore[no-any-return]

        mine = await usage(a)
        assert mine["regions"] == {"a": 4}
        assert mine["total"] == 4
        assert 0 < mine["remaining"] <= 30 - 4  # a's rights less its 4

        async def seen_by_b() -> bool:
            return (await usage(b))["regions"].get("a") == 4  # type: ignore[attr-defined]

        await eventually(seen_by_b, timeout=10, what="a's count in b's usage, from a's advert")
        async with session.post(f"{a.url}/v1/reset", json={"rule": "login", "subject": "u"}) as resp:
            assert resp.status == 400
            assert "escrow" in (await resp.json())["error"]
        assert (await usage(a))["regions"] == {"a": 4}  # nothing was reset
        # A batch with such an item resets nothing, not even the items before it.
        await check(session, a, {"rule": "plain", "subject": "v"})
        batch = [{"rule": "plain", "subject": "v"}, {"rule": "login", "subject": "u"}]
        async with session.post(f"{a.url}/v1/reset", json=batch) as resp:
            assert resp.status == 400
        limiter = a.require_limiter()
        assert (await limiter.usage("plain", "v")).total == 1
        assert await limiter.reset(["plain", "login"], "v") is None  # mixed: the plain rule only
        assert (await limiter.usage("plain", "v")).total == 0

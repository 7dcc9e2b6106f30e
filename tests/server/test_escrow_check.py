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

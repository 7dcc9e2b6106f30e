"""Escrow mode through the middlewares: an aiohttp app in one region and an ASGI app in
another (real agents, real Redis, manual time) hold an escrow rule's limit under a burst
at both at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp

from geolimit import AsyncLimiter, Rule
from geolimit.middleware import GeolimitMiddleware, policy, setup_geolimit
from geolimit.middleware.asgi import Receive, Scope, Send
from geolimit.store.embedded import EmbeddedRedis
from tests.middleware.servers import aiohttp_serving, uvicorn_serving
from tests.middleware.test_aiohttp import app_with
from tests.support.regions import Regions

LOGIN = Rule("login", 6, 60, escrow=True)


async def plain(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"path": scope["path"]}).encode()})


async def test_a_burst_at_an_aiohttp_app_and_an_asgi_app_admits_at_most_the_escrow_limit(
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    async with Regions(redis_server_factory, ["east", "west"], [LOGIN], run_loops=False) as rs:
        await rs.step(2)  # a new Redis holds escrow rules for a window, until every peer was pulled
        rs.clock.advance(LOGIN.window)
        await rs.step(3)
        east = AsyncLimiter.from_url(rs["east"].server.url, region="east", rules=[LOGIN], clock=rs.clock)
        west = AsyncLimiter.from_url(rs["west"].server.url, region="west", rules=[LOGIN], clock=rs.clock)
        routes = [policy("/login", "login")]
        aiohttp_app = app_with(lambda app: setup_geolimit(app, east, routes))
        asgi_app = GeolimitMiddleware(plain, west, routes)
        try:
            async with aiohttp_serving(aiohttp_app) as east_url, aiohttp.ClientSession() as http:
                with uvicorn_serving(asgi_app, on_exit=west.aclose) as west_url:

                    async def attempt(url: str) -> tuple[int, str]:
                        async with http.get(url + "/login") as response:
                            return response.status, response.headers.get("RateLimit", "")

                    answers = await asyncio.gather(*(attempt(url) for url in (east_url, west_url) for _ in range(6)))
        finally:
            await east.aclose()
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200] * 6 + [429] * 6, answers  # each region spends its rights, 3 of 6, and no more
        assert all('"login";' in header for _, header in answers)

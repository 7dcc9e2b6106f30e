"""The aiohttp middleware on a real server (web.AppRunner on an ephemeral port) and a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web

from geolimit import AsyncLimiter, Limiter, Rule
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.http.keys import KeySpec, Route
from geolimit.middleware import geolimit_middleware, policy, setup_geolimit
from geolimit.middleware.aiohttp import VERDICT_KEY
from tests.middleware.servers import (
    aiohttp_serving,
    check_allowed,
    check_denied,
    closed_port,
    prefix,
    sf_list,
)

RULES = [Rule("api", limit=3, window=10), Rule("strict", limit=1, window=10), Rule("bytes", limit=1000, window=10)]


@pytest.fixture
async def make_limiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[Callable[..., AsyncLimiter]]:
    made: list[AsyncLimiter] = []

    def make(url: str = redis_url, **kwargs: Any) -> AsyncLimiter:
        kwargs.setdefault("prefix", prefix())
        made.append(AsyncLimiter.from_url(url, region="east", rules=RULES, **kwargs))
        return made[-1]

    yield make
    for limiter in made:
        await limiter.aclose()


async def ok(request: web.Request) -> web.Response:
    decision = request[VERDICT_KEY].decision
    return web.json_response({"remaining": None if decision is None else decision.remaining})


async def stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"streamed")
    await response.write_eof()
    return response


async def missing(request: web.Request) -> web.Response:
    raise web.HTTPNotFound(text="no such thing")


async def upload(request: web.Request) -> web.Response:
    return web.json_response({"received": len(await request.read())})


def app_with(install: Callable[[web.Application], None]) -> web.Application:
    app = web.Application()
    install(app)
    app.add_routes([
        web.get("/api/ok", ok), web.get("/api/stream", stream), web.get("/api/missing", missing),
        web.get("/health", ok), web.get("/{tail:.*}", ok), web.post("/upload", upload),
    ])
    return app


async def test_three_allowed_then_429_with_headers_and_problem_json(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter()
    app = app_with(lambda app: setup_geolimit(app, limiter, [policy("/api/*", "api")]))
    async with aiohttp_serving(app) as url, aiohttp.ClientSession(url) as http:
        for remaining in (2, 1, 0):
            async with http.get("/api/ok") as response:
                assert response.status == 200
                assert await response.json() == {"remaining": remaining}
                check_allowed(response.headers, "api", 3, 10, remaining)
        async with http.get("/api/ok") as denied:
            check_denied(denied.status, denied.headers, await denied.json(content_type=None), "api", 3, 10, "/api/ok")
        async with http.get("/health") as health:
            assert health.status == 200
            assert "RateLimit" not in health.headers
            assert await health.json() == {"remaining": None}


async def test_streamed_and_raised_responses_get_headers(make_limiter: Callable[..., AsyncLimiter]) -> None:
    routes = [policy("/api/*", "api")]
    with_hook = app_with(lambda app: setup_geolimit(app, make_limiter(), routes, legacy_headers=True))
    bare = app_with(lambda app: app.middlewares.append(geolimit_middleware(make_limiter(), routes)))
    async with aiohttp_serving(with_hook) as url, aiohttp.ClientSession(url) as http:
        async with http.get("/api/stream") as response:
            assert await response.read() == b"streamed"
            check_allowed(response.headers, "api", 3, 10, 2)
            assert response.headers["X-RateLimit-Remaining"] == "2"
        async with http.get("/api/missing") as response:
            assert response.status == 404
            check_allowed(response.headers, "api", 3, 10, 1)
    async with aiohttp_serving(bare) as url, aiohttp.ClientSession(url) as http:
        async with http.get("/api/stream") as response:
            assert await response.read() == b"streamed"
            assert "RateLimit" not in response.headers, "prepared by the handler: documented limitation"
        async with http.get("/api/missing") as response:
            assert response.status == 404
            check_allowed(response.headers, "api", 3, 10, 1)
        async with http.get("/api/ok") as response:
            check_allowed(response.headers, "api", 3, 10, 0)


async def test_trusted_proxies_api_keys_and_byte_quotas(make_limiter: Callable[..., AsyncLimiter]) -> None:
    trusting, distrusting = make_limiter(), make_limiter()
    routes = [
        policy("/upload", "bytes", key="header:X-API-Key", cost="body"),
        policy("/keyed/*", "strict", key="header:X-API-Key"),
        policy("/*", "strict", key="ip"),
    ]
    behind_proxy = app_with(lambda app: setup_geolimit(app, trusting, routes, trusted_proxies=["127.0.0.1", "10.0.0.0/8"]))
    exposed = app_with(lambda app: setup_geolimit(app, distrusting, routes))

    async def status(http: aiohttp.ClientSession, path: str, **headers: str) -> int:
        async with http.get(path, headers=headers) as response:
            return response.status

    async with aiohttp_serving(behind_proxy) as url, aiohttp.ClientSession(url) as http:
        assert await status(http, "/", **{"X-Forwarded-For": "203.0.113.5"}) == 200
        assert await status(http, "/", **{"X-Forwarded-For": "203.0.113.5"}) == 429
        assert await status(http, "/", **{"X-Forwarded-For": "203.0.113.6, 10.1.2.3"}) == 200, "trusted hops skipped"
        assert await status(http, "/", **{"X-Forwarded-For": "1.1.1.1, 203.0.113.6"}) == 429, "left of the client: spoofed"
        assert await status(http, "/keyed/a", **{"X-API-Key": "k1"}) == 200
        assert await status(http, "/keyed/b", **{"X-API-Key": "k1"}) == 429
        assert await status(http, "/keyed/a", **{"X-API-Key": "k2"}) == 200
        uploads = []
        for _ in range(2):
            async with http.post("/upload", data=b"x" * 600, headers={"X-API-Key": "k1"}) as response:
                uploads.append(response.status)
        assert uploads == [200, 429], "600 + 600 bytes exceed 1000 per 10 s"

        async def chunks() -> AsyncIterator[bytes]:
            yield b"no content-length"

        async with http.post("/upload", data=chunks(), headers={"X-API-Key": "k3"}) as response:
            assert response.status == 400
            assert "Content-Length" in (await response.json(content_type=None))["detail"]
    assert (await trusting.usage("strict", "ip=203.0.113.5")).total == 1
    assert (await trusting.usage("bytes", "x-api-key=k1")).total == 600
    assert (await trusting.usage("strict", "ip=127.0.0.1")).total == 0

    async with aiohttp_serving(exposed) as url, aiohttp.ClientSession(url) as http:
        assert await status(http, "/", **{"X-Forwarded-For": "203.0.113.5"}) == 200
        assert await status(http, "/", **{"X-Forwarded-For": "203.0.113.9"}) == 429, "untrusted peers cannot spoof"
    assert (await distrusting.usage("strict", "ip=127.0.0.1")).total == 1


async def test_shadow_limits_and_failure_policies(make_limiter: Callable[..., AsyncLimiter], redis_url: str) -> None:
    limiter = make_limiter()
    shadowed = [RoutePolicy(Route("/*"), (LimitSpec("api", KeySpec("ip")), LimitSpec("strict", shadow=True)))]
    async with aiohttp_serving(app_with(lambda app: setup_geolimit(app, limiter, shadowed))) as url, \
            aiohttp.ClientSession(url) as http:
        statuses = []
        for _ in range(4):
            async with http.get("/x") as response:
                statuses.append(response.status)
                if response.status == 200:
                    assert sf_list(response.headers["RateLimit"])[0][0] == "api"
        assert statuses == [200, 200, 200, 429], "the shadow rule (1 per 10 s) never denies"

    down_async = make_limiter(f"redis://127.0.0.1:{closed_port()}/0", timeout=0.3)
    down_sync = Limiter.from_url(f"redis://127.0.0.1:{closed_port()}/0", region="east", rules=RULES, timeout=0.3)
    failing = [
        RoutePolicy(Route("/open"), (LimitSpec("api", on_error="allow"),)),
        RoutePolicy(Route("/closed"), (LimitSpec("api", on_error="deny"),)),
        RoutePolicy(Route("/shadow-closed"), (LimitSpec("api", on_error="deny", shadow=True),)),
    ]
    for decider in (down_async, down_sync):
        app = app_with(lambda app, d=decider: setup_geolimit(app, d, failing))
        async with aiohttp_serving(app) as url, aiohttp.ClientSession(url) as http:
            async with http.get("/open") as response:
                assert response.status == 200
                assert "RateLimit" not in response.headers
            async with http.get("/closed") as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
                assert response.headers["Content-Type"] == "application/problem+json"
                assert (await response.json(content_type=None))["status"] == 503
            async with http.get("/shadow-closed") as response:
                assert response.status == 200, "a shadow limit never denies, even failing closed"
    down_sync.close()

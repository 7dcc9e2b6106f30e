"""Shared HTTP pieces: client addresses, keys, costs, the guard (headers: test_ratelimit_headers.py)."""

from __future__ import annotations

import pytest

from geolimit import Rule
from geolimit.async_limiter import AsyncLimiter
from geolimit.errors import ConfigError, RequestError
from geolimit.http.guard import Guard, LimitSpec, RoutePolicy
from geolimit.http.keys import (
    CostSpec,
    KeySpec,
    RequestInfo,
    Route,
    client_address,
    trusted_networks,
)


def _req(peer: str, **headers: str) -> RequestInfo:
    return RequestInfo("GET", "/x", {k.lower().replace("_", "-"): v for k, v in headers.items()}, peer)


def test_client_address_honours_forwarding_headers_only_from_trusted_proxies() -> None:
    trusted = trusted_networks(["10.0.0.0/8", "::1"])
    assert client_address(_req("203.0.113.7", x_forwarded_for="1.2.3.4"), trusted) == "203.0.113.7"
    assert client_address(_req("10.0.0.5", x_forwarded_for="1.2.3.4, 10.0.0.9"), trusted) == "1.2.3.4"
    assert client_address(_req("10.0.0.5", x_forwarded_for="6.6.6.6, 1.2.3.4"), trusted) == "1.2.3.4"
    forwarded = 'for=192.0.2.60;proto=http;by=203.0.113.43, for="[2001:db8:cafe::17]:4711"'
    assert client_address(_req("::1", forwarded=forwarded), trusted) == "2001:db8:cafe::17"
    assert client_address(_req("10.0.0.5", x_forwarded_for="garbage, ,"), trusted) == "10.0.0.5"
    assert client_address(_req("10.0.0.5", forwarded="for=unknown"), trusted) == "10.0.0.5"
    with pytest.raises(ConfigError, match="invalid trusted proxy"):
        trusted_networks(["10.0.0.0/33"])


def test_keys_costs_and_routes() -> None:
    route = Route("/users/{id}/posts/*", frozenset({"GET"}))
    params = route.match("GET", "/users/42/posts/a/b")
    assert params == {"id": "42"}
    assert route.match("POST", "/users/42/posts/a") is None
    request = RequestInfo("GET", "/users/42/posts/a", {"x-api-key": "k1", "x-cost": "7"}, "198.51.100.1", 123)
    key = KeySpec("ip+header:X-API-Key+param:id+path")
    assert key.subject(request, params or {}, route.template, ()) == (
        "ip=198.51.100.1|x-api-key=k1|id=42|path=/users/{id}/posts/*")
    assert KeySpec("header:X-Missing").subject(request, {}, "/", ()) == "x-missing=-"
    assert CostSpec("header:X-Cost").cost(request) == 7
    assert CostSpec("body").cost(request) == 123
    with pytest.raises(RequestError, match="Content-Length"):
        CostSpec("body").cost(RequestInfo("POST", "/", {}, None))
    for garbage in ("seven", "-2"):
        with pytest.raises(RequestError, match="X-Cost"):
            CostSpec("header:X-Cost").cost(RequestInfo("GET", "/", {"x-cost": garbage}, None))
    for bad in ("", "ip+", "header:", "cookie:x"):
        with pytest.raises(ConfigError, match="invalid key"):
            KeySpec(bad)
    with pytest.raises(ConfigError, match="invalid cost"):
        CostSpec(-1)


async def test_guard_enforces_shadows_and_fails_per_rule(redis_url: str, redis_client: object) -> None:
    rules = [Rule("api", 2, 60), Rule("watch", 1, 60)]
    async with AsyncLimiter.from_url(redis_url, region="e", rules=rules) as limiter:
        guard = Guard(limiter, [RoutePolicy(Route("/api/*"), (
            LimitSpec("api", KeySpec("ip")), LimitSpec("watch", KeySpec("ip"), shadow=True)))])
        request = RequestInfo("GET", "/api/v1", {}, "192.0.2.1")
        first = await guard.check(request)
        assert first.allowed
        assert not first.shadow_denied
        second = await guard.check(request)
        assert second.allowed, "shadow rules never deny"
        assert second.shadow_denied == ["watch"]
        third = await guard.check(request)
        assert not third.allowed
        assert third.denied_by == ["api"]
        assert dict(third.headers())["Retry-After"]
        assert (await guard.check(RequestInfo("GET", "/other", {}, "192.0.2.1"))).decision is None
    down = AsyncLimiter.from_url("redis://127.0.0.1:1/0", region="e", rules=rules, timeout=0.2)
    guard = Guard(down, [RoutePolicy(Route("/*"), (
        LimitSpec("api", on_error="allow"), LimitSpec("watch", on_error="deny")))])
    verdict = await guard.check(RequestInfo("GET", "/", {}, "192.0.2.1"))
    assert not verdict.allowed
    assert verdict.failed == ["api", "watch"]
    assert verdict.denied_by == ["watch"]
    await down.aclose()

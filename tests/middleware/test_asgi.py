"""The pure ASGI middleware under a real uvicorn, with FastAPI, Starlette and a raw ASGI app."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
import websockets.sync.client
from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from geolimit import AsyncLimiter, Limiter, ManualClock, Rule
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.http.keys import CostSpec, KeySpec, Route
from geolimit.middleware import GeolimitMiddleware, policy
from geolimit.middleware.asgi import Receive, Scope, Send
from tests.middleware.servers import (
    check_allowed,
    check_denied,
    closed_port,
    prefix,
    sf_list,
    uvicorn_serving,
)

RULES = [Rule("api", limit=3, window=10), Rule("strict", limit=1, window=10)]


@pytest.fixture
def make_limiter(redis_url: str, redis_client: redis.Redis) -> Callable[..., AsyncLimiter]:
    """AsyncLimiters on the real Redis, each with a fresh prefix (closed by the server's on_exit)."""

    def make(rules: list[Rule] = RULES, url: str = redis_url, **kwargs: Any) -> AsyncLimiter:
        kwargs.setdefault("prefix", prefix())
        return AsyncLimiter.from_url(url, region="east", rules=rules, **kwargs)

    return make


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A framework-free ASGI app: echoes whether the middleware left a verdict."""
    assert scope["type"] == "http"
    verdict = scope["state"]["geolimit"]
    body = json.dumps({"path": scope["path"], "limited": verdict.decision is not None, "failed": verdict.failed}).encode()
    headers = [(b"content-type", b"application/json")]
    if scope["path"] == "/own-header":
        headers.append((b"ratelimit", b'"mine";r=1;t=1'))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_fastapi_allows_three_then_429s_with_headers_and_problem_json(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter()
    app = FastAPI()
    app.add_middleware(GeolimitMiddleware, limiter_or_decider=limiter, routes=[policy("/api/*", "api")])

    @app.get("/api/items")
    async def items(request: Request) -> dict[str, int]:
        return {"remaining": request.state.geolimit.decision.remaining}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    with uvicorn_serving(app, on_exit=limiter.aclose) as url, httpx.Client(base_url=url, trust_env=False) as http:
        for remaining in (2, 1, 0):
            response = http.get("/api/items")
            assert response.status_code == 200
            assert response.json() == {"remaining": remaining}
            check_allowed(response.headers, "api", 3, 10, remaining)
            assert "X-RateLimit-Limit" not in response.headers
        denied = http.get("/api/items")
        check_denied(denied.status_code, denied.headers, denied.json(), "api", 3, 10, "/api/items")
        head = http.head("/api/items")
        assert head.status_code == 429
        assert head.content == b""
        unlimited = http.get("/health")
        assert unlimited.status_code == 200
        assert "RateLimit" not in unlimited.headers, "unmatched routes are not limited"


def test_raw_asgi_app_legacy_headers_sync_limiter_and_app_headers_win(redis_url: str, redis_client: redis.Redis) -> None:
    sync_limiter = Limiter.from_url(redis_url, region="east", rules=RULES, prefix=prefix())
    app = GeolimitMiddleware.simple(raw_app, sync_limiter, rule="api", key="ip", legacy_headers=True)
    with uvicorn_serving(app, lifespan="off") as url, httpx.Client(base_url=url, trust_env=False) as http:
        first = http.get("/own-header")
        assert first.json() == {"path": "/own-header", "limited": True, "failed": []}
        assert first.headers.get_list("RateLimit") == ['"mine";r=1;t=1'], "the app's own header wins"
        assert sf_list(first.headers["RateLimit-Policy"]) == [("api", {"q": 3, "w": 10})]
        second = http.get("/x")
        assert (second.headers["X-RateLimit-Limit"], second.headers["X-RateLimit-Remaining"]) == ("3", "1")
        assert int(second.headers["X-RateLimit-Reset"]) <= 11
        http.get("/x")
        denied = http.get("/x")
        assert denied.status_code == 429
        assert denied.headers["X-RateLimit-Remaining"] == "0"
    sync_limiter.close()


def test_trusted_proxies_may_forward_the_client_address_others_cannot_spoof_it(
    make_limiter: Callable[..., AsyncLimiter], redis_url: str
) -> None:
    trusting, distrusting = make_limiter(), make_limiter()
    routes = [policy("/*", "strict", key="ip")]
    behind_proxy = GeolimitMiddleware(raw_app, trusting, routes, trusted_proxies=["127.0.0.0/8"])
    exposed = GeolimitMiddleware(raw_app, distrusting, routes)

    async def close() -> None:
        await trusting.aclose()
        await distrusting.aclose()

    def status(http: httpx.Client, forwarded_for: str) -> int:
        return http.get("/", headers={"X-Forwarded-For": forwarded_for}).status_code

    with uvicorn_serving(behind_proxy, lifespan="off", on_exit=close) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        assert status(http, "198.51.100.1") == 200
        assert status(http, "198.51.100.1") == 429
        assert status(http, "198.51.100.2") == 200, "each forwarded client has its own bucket"
        assert status(http, "6.6.6.6, 198.51.100.2") == 429, "only the hop our proxy added counts"
        assert http.get("/", headers={"Forwarded": 'for="[2001:db8::7]:4711"'}).status_code == 200
    with Limiter.from_url(redis_url, region="x", rules=RULES, prefix=trusting.layout.prefix) as reader:
        assert reader.usage("strict", "ip=198.51.100.1").total == 1
        assert reader.usage("strict", "ip=2001:db8::7").total == 1
        assert reader.usage("strict", "ip=127.0.0.1").total == 0

    with uvicorn_serving(exposed, lifespan="off", on_exit=close) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        assert status(http, "198.51.100.1") == 200
        assert status(http, "198.51.100.2") == 429, "an untrusted peer cannot pick its own address"
    with Limiter.from_url(redis_url, region="x", rules=RULES, prefix=distrusting.layout.prefix) as reader:
        assert reader.usage("strict", "ip=127.0.0.1").total == 1


def test_api_key_header_key_and_header_cost(make_limiter: Callable[..., AsyncLimiter], redis_url: str) -> None:
    limiter_url = redis_url
    limiter = make_limiter()
    routes = [
        policy("/metered", "api", key="header:X-API-Key", cost="header:X-Cost"),
        policy("/*", "api", key="header:X-API-Key"),
    ]
    app = GeolimitMiddleware(raw_app, limiter, routes)
    with uvicorn_serving(app, lifespan="off", on_exit=limiter.aclose) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        alice, bob = {"X-API-Key": "alice"}, {"X-API-Key": "bob"}
        assert [http.get("/", headers=alice).status_code for _ in range(4)] == [200, 200, 200, 429]
        assert http.get("/", headers=bob).status_code == 200, "another key, another bucket"
        assert [http.get("/").status_code for _ in range(4)] == [200, 200, 200, 429], "no key: one shared bucket"
        metered = http.get("/metered", headers={"X-API-Key": "carol", "X-Cost": "2"})
        check_allowed(metered.headers, "api", 3, 10, 1)
        for bad in ("lots", "-1"):
            response = http.get("/metered", headers={"X-API-Key": "carol", "X-Cost": bad})
            assert response.status_code == 400
            assert response.headers["Content-Type"] == "application/problem+json"
            assert response.json()["status"] == 400
            assert response.json()["detail"].startswith("cannot read the cost of rule 'api'")
        huge = http.get("/metered", headers={"X-API-Key": "k", "X-Cost": str(2**60)})
        assert huge.status_code == 400
        assert "cost must be from 0 to 2**46 (70368744177664)" in huge.json()["detail"]
        assert http.get("/", headers={"X-API-Key": "k" * 5000}).status_code == 200, "long keys are hashed"
    with Limiter.from_url(limiter_url, region="x", rules=RULES, prefix=limiter.layout.prefix) as reader:
        hashed = "sha256:" + hashlib.sha256(b"x-api-key=" + b"k" * 5000).hexdigest()
        assert reader.usage("api", hashed).total == 1


def test_shadow_limits_count_but_never_deny(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter()
    limits = (LimitSpec("api", KeySpec("ip")), LimitSpec("strict", KeySpec("ip"), shadow=True))
    app = GeolimitMiddleware(raw_app, limiter, [RoutePolicy(Route("/*"), limits)])
    with uvicorn_serving(app, lifespan="off", on_exit=limiter.aclose) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        first = http.get("/")
        assert first.status_code == 200
        assert [name for name, _ in sf_list(first.headers["RateLimit"])] == ["api"], "shadow limits never show"
        second = http.get("/")
        assert second.status_code == 200, "the shadow rule would deny, but only reports"
        check_allowed(second.headers, "api", 3, 10, 1)
        assert second.headers["RateLimit-Policy"] == first.headers["RateLimit-Policy"]
        assert http.get("/").status_code == 200
        assert http.get("/").status_code == 429, "the enforced rule still denies"
    # A shadow limit counts the requests the enforced limits admit (as it would if it were enforced).
    assert app.guard.counters[("strict", "allowed")] == 1
    assert app.guard.counters[("strict", "shadow_denied")] == 2
    assert app.guard.counters[("api", "denied")] == 1


def test_fail_open_and_fail_closed_when_redis_is_unreachable(make_limiter: Callable[..., AsyncLimiter]) -> None:
    down = make_limiter(url=f"redis://127.0.0.1:{closed_port()}/0", timeout=0.3)
    routes = [
        RoutePolicy(Route("/open/*"), (LimitSpec("api", on_error="allow"),)),
        RoutePolicy(Route("/closed/*"), (LimitSpec("api", on_error="deny"),)),
        RoutePolicy(Route("/body"), (LimitSpec("api", cost=CostSpec("body"), on_error="deny"),)),
    ]
    app = GeolimitMiddleware(raw_app, down, routes)
    with uvicorn_serving(app, lifespan="off", on_exit=down.aclose) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        opened = http.get("/open/x")
        assert opened.status_code == 200
        assert opened.json() == {"path": "/open/x", "limited": False, "failed": ["api"]}
        assert "RateLimit" not in opened.headers
        closed = http.get("/closed/x")
        assert closed.status_code == 503
        assert closed.headers["Retry-After"] == "1"
        assert closed.headers["Content-Type"] == "application/problem+json"
        assert closed.json()["title"] == "Service Unavailable"
        assert "'api' fails closed" in closed.json()["detail"]
        assert http.get("/body").status_code == 400, "a byte quota needs a Content-Length"
    assert app.guard.counters == {("api", "error_allow"): 1, ("api", "error_deny"): 1}


def test_lifespan_and_websockets_pass_through(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter()
    events: list[str] = []

    async def lifespan_events(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            events.append(message["type"])
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("echo " + await websocket.receive_text())
        await websocket.close()

    async def hello(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hi")

    starlette = Starlette(routes=[StarletteRoute("/", hello), WebSocketRoute("/ws", echo)])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await (lifespan_events if scope["type"] == "lifespan" else starlette)(scope, receive, send)

    # "strict" allows one request per 10 s on every path, /ws included.
    guarded = GeolimitMiddleware.simple(app, limiter, rule="strict")
    with uvicorn_serving(guarded, lifespan="on", on_exit=limiter.aclose) as url:
        assert events == ["lifespan.startup"]
        ws_url = url.replace("http://", "ws://") + "/ws"
        for i in range(3):
            with websockets.sync.client.connect(ws_url, open_timeout=5) as ws:
                ws.send(f"m{i}")
                assert ws.recv(timeout=5) == f"echo m{i}"
        with httpx.Client(base_url=url, trust_env=False) as http:
            assert http.get("/").status_code == 200
            assert http.get("/").status_code == 429, "HTTP on the same path is limited"
    assert events == ["lifespan.startup", "lifespan.shutdown"]


def test_policy_with_a_multi_rate_string_decides_all_or_nothing(make_limiter: Callable[..., AsyncLimiter]) -> None:
    rules = Rule.parse_many("search", "3/hour;2/minute")
    limiter = make_limiter(rules)
    app = GeolimitMiddleware(raw_app, limiter, [policy("/*", rules)])
    with uvicorn_serving(app, lifespan="off", on_exit=limiter.aclose) as url, httpx.Client(
        base_url=url, trust_env=False
    ) as http:
        responses = [http.get("/") for _ in range(3)]
        assert [r.status_code for r in responses] == [200, 200, 429]
        assert [name for name, _ in sf_list(responses[0].headers["RateLimit-Policy"])] == ["search.1h", "search.1m"]
        assert responses[2].json()["violated-policies"] == ["search.1m"]
        [(_, hour), (_, minute)] = sf_list(responses[2].headers["RateLimit"])
        assert (hour["r"], minute["r"]) == (1, 0), "the denied request consumed nothing of the hour"


def test_a_client_told_r0_t_is_denied_before_t_and_admitted_at_t(redis_url: str) -> None:
    # "api": 3 per 10 s in 1 s buckets. Hits at 0 s, 3 s and 7 s leave r=0; the
    # oldest (bucket 0) leaves the counted window at 11 s, so t is 4 (not 1, the
    # next bucket boundary, which was all the script could say before).
    clock = ManualClock(1_700_000_000.0)
    sync_limiter = Limiter.from_url(redis_url, region="east", rules=RULES, prefix=prefix(), clock=clock)
    app = GeolimitMiddleware.simple(raw_app, sync_limiter, rule="api", key="ip")
    with uvicorn_serving(app, lifespan="off") as url, httpx.Client(base_url=url, trust_env=False) as http:
        for gap in (0.0, 3.0, 4.0):
            clock.advance(gap)
            response = http.get("/x")
            assert response.status_code == 200
        [(_, params)] = sf_list(response.headers["RateLimit"])
        assert (params["r"], params["t"]) == (0, 4)
        clock.advance_us(params["t"] * 1_000_000 - 1)
        denied = http.get("/x")
        assert denied.status_code == 429, "1 us before t: still no quota"
        assert denied.headers["Retry-After"] == "1"
        clock.advance_us(1)
        assert http.get("/x").status_code == 200, "at t: admitted"
    sync_limiter.close()

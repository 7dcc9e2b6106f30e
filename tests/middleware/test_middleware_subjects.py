"""What the README says about the middleware's subjects and header costs, checked on a real Redis.

The subject is the key's parts as ``name=value`` joined by ``|`` (so operators can look it up with
``/v1/usage``); a missing key header reads ``-`` (one shared bucket); a missing cost header costs 0.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from geolimit import AsyncLimiter, Rule
from geolimit.middleware import GeolimitMiddleware, policy
from geolimit.middleware.asgi import Message, Receive, Scope, Send
from tests.middleware.servers import prefix


@pytest.fixture
async def limiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[AsyncLimiter]:
    made = AsyncLimiter.from_url(redis_url, region="east", rules=[Rule("api", 2, 10)], prefix=prefix())
    yield made
    await made.aclose()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def status(middleware: GeolimitMiddleware, path: str, **headers: str) -> int:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    raw = [(name.replace("_", "-").lower().encode(), value.encode()) for name, value in headers.items()]
    await middleware({"type": "http", "method": "GET", "path": path, "headers": raw,
                      "client": ("203.0.113.9", 5000)}, receive, send)
    return int(sent[0]["status"])


async def test_the_subject_is_name_value_parts_joined_by_a_bar(limiter: AsyncLimiter) -> None:
    middleware = GeolimitMiddleware(app, limiter, [policy("/t/{id}", "api", key="ip+header:X-Tenant+param:id+method")])
    assert await status(middleware, "/t/7", x_tenant="acme") == 200
    usage = await limiter.usage("api", "ip=203.0.113.9|x-tenant=acme|id=7|method=GET")
    assert usage.total == 1
    only = GeolimitMiddleware(app, limiter, [policy("/*", "api", key="header:X-Tenant")])
    assert await status(only, "/x", x_tenant="acme") == 200
    assert (await limiter.usage("api", "x-tenant=acme")).total == 1


async def test_requests_without_the_key_header_share_the_bucket_named_dash(limiter: AsyncLimiter) -> None:
    middleware = GeolimitMiddleware(app, limiter, [policy("/*", "api", key="header:X-API-Key")])
    assert [await status(middleware, "/x") for _ in range(3)] == [200, 200, 429]
    assert (await limiter.usage("api", "x-api-key=-")).total == 2
    assert await status(middleware, "/x", x_api_key="k1") == 200, "a key of its own is not in that bucket"


async def test_a_missing_cost_header_costs_nothing_even_past_the_limit(limiter: AsyncLimiter) -> None:
    middleware = GeolimitMiddleware(app, limiter, [policy("/*", "api", cost="header:X-Cost")])
    assert await status(middleware, "/x", x_cost="2") == 200
    assert await status(middleware, "/x", x_cost="1") == 429
    assert [await status(middleware, "/x") for _ in range(5)] == [200] * 5
    assert (await limiter.usage("api", "ip=203.0.113.9")).total == 2

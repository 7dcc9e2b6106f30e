"""The middlewares check their routes' rule names against the limiter's rules at setup (real Redis).

Once, `GeolimitMiddleware(..., routes=[policy("/api/*", "apx")])` and `setup_geolimit(app, lim, [...])`
accepted a name the limiter does not know, and every matching request then raised
`UnknownRuleError` and answered 500; a multi-rate group's name (`api` for `api.10s` and `api.1h`)
did the same. The proxy refuses both mistakes at start.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
from aiohttp import web

from geolimit import AsyncLimiter, ConfigError, Limiter, Rule
from geolimit.middleware import GeolimitMiddleware, geolimit_middleware, policy, setup_geolimit
from geolimit.middleware.asgi import Message, Receive, Scope, Send
from tests.middleware.servers import prefix

RULES = [Rule("api", limit=3, window=10), Rule("strict", limit=1, window=10)]


@pytest.fixture
async def make_limiter(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[Callable[..., AsyncLimiter]]:
    made: list[AsyncLimiter] = []

    def make(rules: list[Rule] = RULES, **kwargs: Any) -> AsyncLimiter:
        made.append(AsyncLimiter.from_url(redis_url, region="east", rules=rules, prefix=prefix(), **kwargs))
        return made[-1]

    yield make
    for limiter in made:
        await limiter.aclose()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def call(middleware: GeolimitMiddleware, path: str = "/api/x") -> tuple[int, dict[str, str]]:
    """One GET through the middleware: its status and headers."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "client": ("203.0.113.9", 5000)}
    await middleware(scope, receive, send)
    start = sent[0]
    return start["status"], {bytes(n).decode().lower(): bytes(v).decode() for n, v in start["headers"]}


async def test_asgi_refuses_an_unknown_rule_at_setup(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter()
    routes = [policy("/public/*", "api"), policy("/api/*", "apx", key="ip")]
    with pytest.raises(ConfigError) as caught:
        GeolimitMiddleware(app, limiter_or_decider=limiter, routes=routes)
    assert str(caught.value) == "route[1] (path '/api/*'): unknown rule 'apx'; known rules: api, strict"
    with pytest.raises(ConfigError, match="unknown rule 'apx'"):
        GeolimitMiddleware.simple(app, limiter, rule="apx")


def test_aiohttp_refuses_an_unknown_rule_at_setup(redis_url: str, redis_client: redis.Redis) -> None:
    with Limiter.from_url(redis_url, region="east", rules=RULES, prefix=prefix()) as limiter:
        web_app = web.Application()
        with pytest.raises(ConfigError, match=r"^route\[0\] \(path '/api/\*'\): unknown rule 'apx'; known rules: "
                                              r"api, strict$"):
            setup_geolimit(web_app, limiter, [policy("/api/*", "apx", key="ip")])
        assert not web_app.middlewares, "nothing is installed"
        with pytest.raises(ConfigError, match="unknown rule 'apx'"):
            geolimit_middleware(limiter, [policy("/api/*", ["api", "apx"])])


async def test_a_group_name_applies_all_its_rules_all_or_nothing(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter(Rule.parse_many("api", "2/10s;100/1h"))
    middleware = GeolimitMiddleware(app, limiter, [policy("/api/*", "api")])
    assert [limit.rule for limit in middleware.guard.policies[0].limits] == ["api.10s", "api.1h"]
    for remaining in (1, 0):
        status, headers = await call(middleware)
        assert status == 200
        shown = {name: r for name, r in re.findall(r'"([^"]+)";r=(\d+)', headers["ratelimit"])}
        assert shown == {"api.10s": str(remaining), "api.1h": str(98 + remaining)}, headers
    status, headers = await call(middleware)
    assert status == 429, headers
    assert (await limiter.peek("api.1h", "ip=203.0.113.9")).remaining == 98, "the denied request consumed nothing"


async def test_group_errors_say_to_name_the_rules(make_limiter: Callable[..., AsyncLimiter]) -> None:
    limiter = make_limiter([*Rule.parse_many("api", "2/10s;100/1h"), Rule("burst.x", 5, 10)])
    with pytest.raises(ConfigError) as caught:
        GeolimitMiddleware(app, limiter, [policy("/api/*", "ap")])
    assert str(caught.value) == ("route[0] (path '/api/*'): unknown rule 'ap'; known rules: api.10s, api.1h, "
                                 "burst.x; multi-rate groups: api (api.10s + api.1h)")
    with pytest.raises(ConfigError) as caught:  # not a group: one rule named after a window would be
        GeolimitMiddleware(app, limiter, [policy("/api/*", "burst")])
    assert "name them, as rule=['burst.x'] (decided all-or-nothing)" in str(caught.value)
    with pytest.raises(ConfigError, match=r"rule 'api.1h' is named twice \(directly and by its group 'api'\)"):
        GeolimitMiddleware(app, limiter, [policy("/api/*", ["api.1h", "api"])])


async def test_a_rule_removed_after_setup_fails_by_on_error_not_500(
        make_limiter: Callable[..., AsyncLimiter], caplog: pytest.LogCaptureFixture) -> None:
    """As the proxy does for a rule its agent does not know: the limit fails by its on_error, logged."""
    limiter = make_limiter()
    allow = GeolimitMiddleware(app, limiter, [policy("/api/*", "strict")])
    deny = GeolimitMiddleware(app, limiter, [policy("/api/*", "strict", on_error="deny")])
    limiter.set_rules([RULES[0]])
    status, _ = await call(allow)
    assert status == 200
    status, headers = await call(deny)
    assert status == 503
    assert headers["retry-after"] == "1"
    assert "cannot decide rule(s) strict (configuration problem)" in caplog.text
    assert "unknown rule 'strict'" in caplog.text

"""A route's limits are decided all-or-nothing; shadow limits never show; against a real Redis."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import http_sfv
import pytest

from geolimit import AsyncLimiter, Rule
from geolimit.core.decision import Decision
from geolimit.http.guard import Guard, LimitSpec, RoutePolicy
from geolimit.http.keys import CostSpec, KeySpec, RequestInfo, Route

RULES = [Rule("api", 5, 60), Rule("burst", 2, 60), Rule("bytes", 100, 60), Rule("watch", 1, 60),
         *Rule.parse_many("multi", "4/hour;2/minute")]


@pytest.fixture
async def limiter(redis_url: str) -> AsyncIterator[AsyncLimiter]:
    async with AsyncLimiter.from_url(redis_url, region="e", rules=RULES, prefix="g" + secrets.token_hex(4)) as made:
        yield made


def request(path: str = "/api/x", length: int | None = None, **headers: str) -> RequestInfo:
    return RequestInfo("POST", path, {k.lower().replace("_", "-"): v for k, v in headers.items()}, "192.0.2.7", length)


async def used(limiter: AsyncLimiter, rule: str, subject: str = "ip=192.0.2.7") -> int:
    return (await limiter.usage(rule, subject)).total


def names(value: str) -> list[str]:
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    return [str(item.value) for item in parsed]


class CountingDecider:
    """The limiter, counting its calls (to show one atomic call per group)."""

    def __init__(self, inner: AsyncLimiter) -> None:
        self.inner = inner
        self.calls: list[tuple[str, object]] = []

    async def hit(self, rules: str | list[str], subject: str | bytes, cost: int = 1) -> Decision:
        self.calls.append(("hit", rules))
        return await self.inner.hit(rules, subject, cost)

    async def peek(self, rules: str | list[str], subject: str | bytes, cost: int = 1) -> Decision:
        self.calls.append(("peek", rules))
        return await self.inner.peek(rules, subject, cost)


async def test_a_request_denied_by_burst_consumes_nothing_of_api(limiter: AsyncLimiter) -> None:
    decider = CountingDecider(limiter)
    guard = Guard(decider, [RoutePolicy(Route("/api/*"), (LimitSpec("api"), LimitSpec("burst")))])
    outcomes = [(await guard.check(request())).allowed for _ in range(4)]
    assert outcomes == [True, True, False, False]
    assert await used(limiter, "api") == 2, "the two denied requests consumed nothing of api"
    assert await used(limiter, "burst") == 2
    assert decider.calls == [("hit", ["api", "burst"])] * 4, "one atomic call per request"
    denied = await guard.check(request())
    assert denied.denied_by == ["burst"]
    assert names(dict(denied.headers())["RateLimit"]) == ["api", "burst"]


async def test_limits_with_different_costs_are_peeked_then_consumed(limiter: AsyncLimiter) -> None:
    decider = CountingDecider(limiter)
    limits = (LimitSpec("api"), LimitSpec("bytes", cost=CostSpec("body")))
    guard = Guard(decider, [RoutePolicy(Route("/api/*"), limits)])
    assert (await guard.check(request(length=60))).allowed
    assert sorted(decider.calls, key=str) == sorted(
        [("peek", "api"), ("peek", "bytes"), ("hit", "api"), ("hit", "bytes")], key=str)
    too_big = await guard.check(request(length=60))
    assert not too_big.allowed
    assert too_big.denied_by == ["bytes"]
    assert (await used(limiter, "api"), await used(limiter, "bytes")) == (1, 60), "the denial consumed nothing"
    headers = dict(too_big.headers())
    policy = http_sfv.List()
    policy.parse(headers["RateLimit-Policy"].encode())
    assert [(item.value, dict(item.params)) for item in policy] == [
        ("api", {"q": 5, "w": 60}), ("bytes", {"q": 100, "qu": "content-bytes", "w": 60})]


async def test_limits_with_different_keys_are_all_or_nothing_too(limiter: AsyncLimiter) -> None:
    limits = (LimitSpec("api", KeySpec("ip")), LimitSpec("burst", KeySpec("header:X-API-Key")))
    guard = Guard(limiter, [RoutePolicy(Route("/api/*"), limits)])
    for _ in range(2):
        assert (await guard.check(request(x_api_key="k"))).allowed
    assert not (await guard.check(request(x_api_key="k"))).allowed
    assert await used(limiter, "api") == 2
    assert (await guard.check(request(x_api_key="other"))).allowed, "another key, its own burst bucket"
    assert await used(limiter, "api") == 3


async def test_a_multi_rate_rule_is_one_atomic_call(limiter: AsyncLimiter) -> None:
    decider = CountingDecider(limiter)
    guard = Guard(decider, [RoutePolicy(Route("/*"), (LimitSpec("multi.1h"), LimitSpec("multi.1m")))])
    assert [(await guard.check(request())).allowed for _ in range(3)] == [True, True, False]
    assert await used(limiter, "multi.1h") == 2
    assert {call for call, _ in decider.calls} == {"hit"}


async def test_shadow_limits_never_show_and_never_change_the_policy(limiter: AsyncLimiter) -> None:
    guard = Guard(limiter, [RoutePolicy(Route("/api/*"), (LimitSpec("api"), LimitSpec("watch", shadow=True)))])
    policies, legacy = set(), set()
    for i in range(6):
        verdict = await guard.check(request())
        headers = dict(verdict.headers(legacy=True))
        policies.add(headers["RateLimit-Policy"])
        assert names(headers["RateLimit"]) == ["api"]
        legacy.add((headers["X-RateLimit-Limit"], headers["X-RateLimit-Remaining"]))
        assert verdict.shadow_denied == ([] if i == 0 or i == 5 else ["watch"])
        assert verdict.shadow is not None or i == 5
    assert policies == {'"api";q=5;w=60'}
    assert legacy == {("5", str(r)) for r in (4, 3, 2, 1, 0)}, "X-RateLimit-* come from enforced limits only"
    assert await used(limiter, "watch") == 1, "a shadow limit counts what it would admit if it were enforced"
    only_shadow = Guard(limiter, [RoutePolicy(Route("/*"), (LimitSpec("watch", shadow=True),))])
    verdict = await only_shadow.check(request("/y"))
    assert verdict.allowed
    assert verdict.headers() == []
    assert verdict.shadow is not None


async def test_storage_failures_apply_per_limit() -> None:
    down = AsyncLimiter.from_url("redis://127.0.0.1:1/0", region="e", rules=RULES, timeout=0.2)
    try:
        limits = (LimitSpec("api", on_error="allow"), LimitSpec("bytes", cost=CostSpec("body"), on_error="deny"))
        guard = Guard(down, [RoutePolicy(Route("/*"), limits)])
        verdict = await guard.check(request("/", length=10))
        assert not verdict.allowed
        assert verdict.failed == ["api", "bytes"]
        assert verdict.denied_by == ["bytes"]
        assert verdict.decision is None
    finally:
        await down.aclose()

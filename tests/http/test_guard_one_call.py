"""Routes that one hit decides (Guard.check_one) get the verdicts of the general path; against a real Redis."""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator

import pytest

from geolimit import AsyncLimiter, Rule
from geolimit.http.guard import Guard, LimitSpec, OneCall, RoutePolicy, Verdict
from geolimit.http.keys import CostSpec, KeySpec, RequestInfo, Route

RULES = [Rule("api", 5, 60), Rule("burst", 3, 60), Rule("big", 10, 60)]
POLICIES = [
    RoutePolicy(Route("/two/*"), (LimitSpec("api"), LimitSpec("burst", on_error="deny"))),
    RoutePolicy(Route("/one/{id}"), (LimitSpec("burst", KeySpec("ip+param:id")),)),
    RoutePolicy(Route("/cost"), (LimitSpec("big", cost=CostSpec(4)),)),
]


@pytest.fixture
async def limiters(redis_url: str) -> AsyncIterator[tuple[AsyncLimiter, AsyncLimiter]]:
    async with AsyncLimiter.from_url(redis_url, region="e", rules=RULES, prefix="g" + secrets.token_hex(4)) as a, \
            AsyncLimiter.from_url(redis_url, region="e", rules=RULES, prefix="g" + secrets.token_hex(4)) as b:
        yield a, b


def request(path: str, peer: str = "192.0.2.7") -> RequestInfo:
    return RequestInfo("GET", path, {"host": "example"}, peer)


def general(guard: Guard) -> Guard:
    guard._one_call.clear()  # every route through the general path
    return guard


def timeless(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(name, re.sub(r";t=\d+", "", value)) for name, value in headers if not name.startswith("X-RateLimit-Re")]


def same(one: Verdict, other: Verdict) -> None:
    """The same verdict (times aside: the two were decided a moment apart)."""
    assert (one.allowed, one.denied_by, one.failed, one.units) == (
        other.allowed, other.denied_by, other.failed, other.units)
    assert timeless(one.headers(legacy=True)) == timeless(other.headers(legacy=True))
    if one.decision is None or other.decision is None:
        assert one.decision is other.decision
        return
    assert [(r.rule, r.allowed, r.limit, r.remaining, r.window) for r in one.decision.results] == [
        (r.rule, r.allowed, r.limit, r.remaining, r.window) for r in other.decision.results]
    for mine, theirs in zip(one.decision.results, other.decision.results, strict=True):
        assert abs(mine.reset_after - theirs.reset_after) < 1.0
        assert abs(mine.retry_after - theirs.retry_after) < 1.0


def test_which_routes_one_hit_decides() -> None:
    assert all(OneCall.of(p) is not None for p in POLICIES)
    two = OneCall.of(POLICIES[0])
    assert two is not None
    assert (two.rules, two.cost) == (("api", "burst"), 1)
    assert OneCall.of(RoutePolicy(Route("/"), ())) is None
    assert OneCall.of(RoutePolicy(Route("/"), (LimitSpec("api"), LimitSpec("burst", shadow=True)))) is None
    assert OneCall.of(RoutePolicy(Route("/"), (LimitSpec("api"), LimitSpec("burst", KeySpec("path"))))) is None
    assert OneCall.of(RoutePolicy(Route("/"), (LimitSpec("api", cost=CostSpec("header:X-Cost")),))) is None
    assert OneCall.of(RoutePolicy(Route("/"), (LimitSpec("api"), LimitSpec("burst", cost=CostSpec(2))))) is None
    assert OneCall.of(RoutePolicy(Route("/"), (LimitSpec("api"), LimitSpec("api", KeySpec("ip"))))) is None


async def test_the_same_verdicts_and_counters_as_the_general_path(
        limiters: tuple[AsyncLimiter, AsyncLimiter]) -> None:
    fast, slow = Guard(limiters[0], POLICIES), general(Guard(limiters[1], POLICIES))
    paths = ["/two/a", "/one/1", "/cost", "/one/2", "/two/b", "/elsewhere"]
    allowed = denied = 0
    for _ in range(5):
        for path in paths:
            one, other = await fast.check(request(path)), await slow.check(request(path))
            same(one, other)
            allowed += one.allowed
            denied += not one.allowed
    assert allowed  # both outcomes compared
    assert denied
    assert fast.counters == slow.counters
    # /two/*: burst (3) admits 3 of the 10 requests; all-or-nothing, api admits only those 3.
    assert fast.counters[("api", "allowed")] == 3
    assert ("api", "denied") not in fast.counters


async def test_storage_down_each_limit_by_its_on_error() -> None:
    async def verdicts(guard: Guard) -> list[Verdict]:
        return [await guard.check(request(path)) for path in ("/two/a", "/one/1")]

    async with AsyncLimiter.from_url("redis://127.0.0.1:1", region="e", rules=RULES, timeout=0.2) as down:
        fast, slow = Guard(down, POLICIES), general(Guard(down, POLICIES))
        for one, other in zip(await verdicts(fast), await verdicts(slow), strict=True):
            same(one, other)
    assert fast.counters == slow.counters == {("api", "error_allow"): 1, ("burst", "error_deny"): 1,
                                              ("burst", "error_allow"): 1}

"""The proxy's agent mode: AgentClient decides several rules at once, peeks, and carries what the
headers need (against a real agent on loopback and its own redis-server)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from geolimit import Rule
from geolimit.http.agent_client import AgentClient
from geolimit.http.guard import Guard, LimitSpec, RoutePolicy
from geolimit.http.headers import rate_limit_headers
from geolimit.http.keys import RequestInfo, Route
from geolimit.proxy.decider import ProxyDecider
from geolimit.store.embedded import EmbeddedRedis
from tests.support.agent_fixtures import agent_client

RULES = (Rule("api", 5, 10, 1), Rule("burst", 2, 10, 1), *Rule.parse_many("multi", "4/hour;2/minute"))


@pytest.fixture
async def client(redis_server_factory: Callable[..., EmbeddedRedis]) -> AsyncIterator[AgentClient]:
    async with agent_client(redis_server_factory(), RULES, {"multi": ("multi.1h", "multi.1m")}) as made:
        yield made


async def test_several_rules_in_one_call_and_peeks_that_consume_nothing(client: AgentClient) -> None:
    peeked = await client.peek(["api", "burst"], "u")
    assert peeked.allowed
    first = await client.hit(["api", "burst"], "u")
    assert [(r.rule, r.remaining) for r in first.results] == [("api", 4), ("burst", 1)]
    assert first.results[0].stable_for == 10.75, "one unit counted: until its bucket leaves, carried over JSON"
    await client.hit(["api", "burst"], "u")
    denied = await client.hit(["api", "burst"], "u")
    assert not denied.allowed
    assert [(r.rule, r.allowed, r.remaining) for r in denied.results] == [("api", True, 3), ("burst", False, 0)]
    headers = dict(rate_limit_headers(denied))
    assert int(headers["Retry-After"]) >= max(int(p.split("t=")[1]) for p in headers["RateLimit"].split(", "))


async def test_a_proxy_guard_over_the_agent_is_all_or_nothing(client: AgentClient) -> None:
    guard = Guard(client, [RoutePolicy(Route("/*"), (LimitSpec("api"), LimitSpec("burst")))])
    request = RequestInfo("GET", "/", {}, "192.0.2.1")
    assert [(await guard.check(request)).allowed for _ in range(4)] == [True, True, False, False]
    usage = await client.peek("api", "ip=192.0.2.1")
    assert usage.remaining == 3, "the denied requests consumed nothing of api"


async def test_a_rule_the_agent_does_not_know_fails_alone(client: AgentClient) -> None:
    guard = Guard(ProxyDecider(client), [RoutePolicy(Route("/*"), (LimitSpec("burst"), LimitSpec("gone")))])
    request = RequestInfo("GET", "/", {}, "192.0.2.2")
    verdicts = [await guard.check(request) for _ in range(3)]
    assert [v.allowed for v in verdicts] == [True, True, False], "burst is still enforced"
    assert verdicts[0].failed == ["gone"], "the unknown rule fails open (its on_error) on its own"
    assert verdicts[2].denied_by == ["burst"]


async def test_a_guard_shows_every_rule_of_a_table_the_agent_decides_for_one_name(client: AgentClient) -> None:
    # "multi" is a multi-rate table at the agent: one name, two rules, decided with burst in one call.
    guard = Guard(ProxyDecider(client), [RoutePolicy(Route("/*"), (LimitSpec("multi"), LimitSpec("burst")))])
    request = RequestInfo("GET", "/", {}, "192.0.2.3")
    verdicts = [await guard.check(request) for _ in range(3)]
    assert [v.allowed for v in verdicts] == [True, True, False]
    decision = verdicts[2].decision
    assert decision is not None
    assert [(r.rule, r.allowed) for r in decision.results] == [
        ("multi.1h", True), ("multi.1m", False), ("burst", False)]
    assert verdicts[2].denied_by == ["multi", "burst"]
    assert [item.split(";")[0] for item in dict(verdicts[2].headers())["RateLimit"].split(", ")] == [
        '"multi.1h"', '"multi.1m"', '"burst"']
    assert (await client.peek("multi.1h", "ip=192.0.2.3")).remaining == 2, "the denial consumed nothing"

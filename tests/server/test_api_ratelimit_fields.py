"""``POST /v1/check`` carries the IETF RateLimit fields the proxy sends, and takes the name of a multi-rate
``[[rule]]`` table for all of its rules (a real agent read from TOML, a real Redis, a manual clock)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import http_sfv
import pytest

from geolimit import ManualClock
from geolimit.server.agent import Agent
from geolimit.server.config import parse_config
from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import region_config
from tests.support.regions import dead_url

START = 1_700_000_000.25  # a quarter into a 1 s bucket
#: The fields of a decision's body before /v1/check had headers: they stay exactly these.
BODY = {"allowed", "limit", "remaining", "retry_after", "reset_after", "rule", "degraded", "rules"}


def sf_list(value: str) -> list[tuple[str, dict[str, Any]]]:
    parsed = http_sfv.List()
    parsed.parse(value.encode("ascii"))
    return [(str(item.value), dict(item.params)) for item in parsed]


class Api:
    """The agent's API over HTTP: ``(status, headers, JSON body)`` of each call."""

    def __init__(self, session: aiohttp.ClientSession, agent: Agent) -> None:
        self.session = session
        self.url = agent.api_url

    async def post(self, path: str, body: object) -> tuple[int, dict[str, str], Any]:
        async with self.session.post(self.url + path, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.json()

    async def get(self, path: str, **params: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path, params=params) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def clock_agent(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis]
) -> AsyncIterator[tuple[Api, ManualClock]]:
    server = redis_server_factory()
    (tmp_path / "gossip.key").write_text(secrets.token_hex(32) + "\n")
    data = region_config(server.url, peers=[{"name": "b", "url": dead_url()}], rules=[
        {"name": "api", "limit": "5/10s", "resolution": 1}, {"name": "multi", "limit": "4/hour;2/minute"}])
    config = parse_config(data, tmp_path / "region.toml")
    clock = ManualClock(START)
    agent = Agent(replace(config, listen=("127.0.0.1", 0)), clock=clock)
    await agent.listen()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            yield Api(session, agent), clock
    finally:
        await agent.abort()
        server.stop()


async def test_check_answers_carry_the_fields_and_retry_after_is_honest(
    clock_agent: tuple[Api, ManualClock],
) -> None:
    api, clock = clock_agent
    user = {"rule": "api", "subject": "user:42"}
    for remaining in (4, 3, 2, 1, 0):
        status, headers, body = await api.post("/v1/check", user)
        assert (status, set(body), body["allowed"], body["remaining"]) == (200, BODY, True, remaining)
        assert sf_list(headers["RateLimit-Policy"]) == [("api", {"q": 5, "w": 10})]
        # One 1 s bucket counts (0.25 s into it): remaining cannot grow until it leaves the 10 s window.
        assert sf_list(headers["RateLimit"]) == [("api", {"r": remaining, "t": 10})]
        assert "Retry-After" not in headers
    status, headers, body = await api.post("/v1/check", user)
    assert (status, set(body), body["allowed"], body["retry_after"]) == (200, BODY, False, 10.75)
    [(_, current)] = sf_list(headers["RateLimit"])
    retry_after = int(headers["Retry-After"])
    assert (current["r"], current["t"], retry_after) == (0, 10, 11), "Retry-After is not before the window's end"

    clock.advance(current["t"] - 0.001)  # within t, nothing more than r (0) is admitted
    status, _, peeked = await api.post("/v1/peek", user)
    assert (status, peeked["allowed"]) == (200, False)
    clock.set(START + retry_after)  # and after Retry-After the same request passes
    status, headers, body = await api.post("/v1/check", user)
    assert (status, body["allowed"]) == (200, True)
    assert sf_list(headers["RateLimit"])[0][1]["r"] == 4


async def test_a_cost_above_the_limit_is_denied_without_retry_after(clock_agent: tuple[Api, ManualClock]) -> None:
    api, _ = clock_agent
    status, headers, body = await api.post("/v1/check", {"rule": "api", "subject": "big", "cost": 6})
    assert (status, body["allowed"], body["retry_after"]) == (200, False, None)
    assert "Retry-After" not in headers, "no wait admits a cost of 6 under a limit of 5"
    assert sf_list(headers["RateLimit"])[0][1]["r"] == 5, "and it consumed nothing"


async def test_a_batch_answers_each_decision_in_its_result(clock_agent: tuple[Api, ManualClock]) -> None:
    api, _ = clock_agent
    status, headers, body = await api.post("/v1/check", [{"rule": "api", "subject": "a"},
                                                         {"rule": "api", "subject": "b", "cost": 2}])
    assert status == 200
    assert [(r["remaining"], set(r)) for r in body["results"]] == [(4, BODY), (3, BODY)]
    assert "RateLimit" not in headers, "decisions for several subjects: no one set of fields describes them"


async def test_a_multi_rate_table_name_decides_all_of_its_rules(clock_agent: tuple[Api, ManualClock]) -> None:
    api, _ = clock_agent
    multi = {"rule": "multi", "subject": "u"}
    for hourly, minutely in ((3, 1), (2, 0)):
        status, headers, body = await api.post("/v1/check", multi)
        assert (status, body["allowed"]) == (200, True)
        assert [(r["rule"], r["remaining"]) for r in body["rules"]] == [("multi.1h", hourly), ("multi.1m", minutely)]
        assert sf_list(headers["RateLimit-Policy"]) == [("multi.1h", {"q": 4, "w": 3600}),
                                                        ("multi.1m", {"q": 2, "w": 60})]
        assert [(name, p["r"]) for name, p in sf_list(headers["RateLimit"])] == [
            ("multi.1h", hourly), ("multi.1m", minutely)]
    status, headers, body = await api.post("/v1/check", multi)
    assert (status, body["allowed"], body["rule"]) == (200, False, "multi.1m"), "the minute's limit binds"
    assert [(r["rule"], r["allowed"]) for r in body["rules"]] == [("multi.1h", True), ("multi.1m", False)]
    assert int(headers["Retry-After"]) >= max(p["t"] for _, p in sf_list(headers["RateLimit"]))
    status, usage = await api.get("/v1/usage", rule="multi.1h", subject="u")
    assert (status, usage["total"]) == (200, 2), "all-or-nothing: the denied check consumed no hourly unit"

    status, refused = await api.get("/v1/usage", rule="multi", subject="u")
    assert (status, refused["field"]) == (400, "rule")
    assert "multi.1h, multi.1m" in refused["error"]
    status, _, twice = await api.post("/v1/check", {"rules": ["multi", "multi.1m"], "subject": "u"})
    assert (status, twice["field"]) == (400, "rules")
    status, _, unknown = await api.post("/v1/check", {"rule": "multi.1d", "subject": "u"})
    assert (status, unknown["field"]) == (404, "rule")

    status, _, reset = await api.post("/v1/reset", multi)
    assert (status, reset) == (200, {"reset": 1})
    status, _, body = await api.post("/v1/peek", multi)
    assert [(r["rule"], r["remaining"]) for r in body["rules"]] == [("multi.1h", 4), ("multi.1m", 2)]
    status, described = await api.get("/v1/status")
    assert described["rule_groups"] == {"multi": ["multi.1h", "multi.1m"]}

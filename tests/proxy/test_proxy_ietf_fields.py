"""The proxy to the letter of the ratelimit-headers draft: all-or-nothing routes, multi-rate rules,
byte quotas, request-counted costs, percent-encoded problem instances, the fields on 502/504 answers and
denials that no wait can lift (real upstream, real Redis)."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import http_sfv
import pytest
import redis

from geolimit import Limiter, Rule
from tests.proxy.helpers import StartProxy, Upstream, metric_lines, proxy_config
from tests.support.regions import dead_url

QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"


def sf_list(value: str) -> list[tuple[str, dict[str, Any]]]:
    parsed = http_sfv.List()
    parsed.parse(value.encode("ascii"))
    return [(str(item.value), dict(item.params)) for item in parsed]


def config(upstream: Upstream, redis_url: str) -> dict[str, Any]:
    return proxy_config(
        [upstream.url], redis_url=redis_url,
        rules=[{"name": "api", "limit": "5/60s"}, {"name": "burst", "limit": "2/60s"},
               {"name": "multi", "limit": "3 per hour | 2per minute"}, {"name": "bytes", "limit": "100/60s"},
               {"name": "units", "limit": "10/60s"}],
        routes=[
            {"path": "/both", "limits": [{"rule": "api"}, {"rule": "burst"}]},
            {"path": "/mixed", "methods": ["POST"], "limits": [{"rule": "api"}, {"rule": "bytes", "cost": "body"}]},
            {"path": "/multi", "limits": [{"rule": "multi"}]},
            {"path": "/costly", "limits": [{"rule": "units", "cost": 3}]},
            {"path": "/api/*", "limits": [{"rule": "burst", "key": "path"}]},
            {"path": "/metered/*", "limits": [{"rule": "units", "cost": "header:X-Cost"}]},
        ],
    )


def usage(redis_url: str, rule: Rule, subject: str = "ip=127.0.0.1") -> int:
    with Limiter.from_url(redis_url, region="a", rules=[rule]) as reader:
        return reader.usage(rule.name, subject).total


async def test_a_request_denied_by_burst_does_not_consume_api(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(config(upstream, redis_url))
    statuses = []
    for _ in range(4):
        async with session.get(proxy.url + "/both") as resp:
            statuses.append(resp.status)
            last = resp
    assert statuses == [200, 200, 429, 429]
    assert [name for name, _ in sf_list(last.headers["RateLimit"])] == ["api", "burst"]
    assert usage(redis_url, Rule("api", 5, 60)) == 2, "the two denied requests left api untouched"
    counted = {}
    for key, n in (await metric_lines(session, proxy.admin_url or "", "geolimit_proxy_decisions_total")).items():
        labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
        if labels["route"] == "/both":
            counted[labels["rule"], labels["result"]] = n
    assert counted == {("api", "allowed"): 2, ("burst", "allowed"): 2, ("burst", "denied"): 2}, \
        "a request that burst refused was admitted by nothing, so api counts no 'allowed' for it"
    # Different costs (a request count and body bytes): peeked first, consumed only if all allow.
    async with session.post(proxy.url + "/mixed", data=b"x" * 60) as resp:
        assert resp.status == 200
        assert sf_list(resp.headers["RateLimit-Policy"]) == [
            ("api", {"q": 5, "w": 60}), ("bytes", {"q": 100, "qu": "content-bytes", "w": 60})]
        assert [params["r"] for _, params in sf_list(resp.headers["RateLimit"])] == [2, 40]
    async with session.post(proxy.url + "/mixed", data=b"x" * 60) as resp:
        assert resp.status == 429
        assert (await resp.json(content_type=None))["violated-policies"] == ["bytes"]
    assert usage(redis_url, Rule("api", 5, 60)) == 3, "the byte quota's denial consumed no request of api"
    async with session.post(proxy.url + "/mixed", data=b"x" * 40) as resp:
        assert resp.status == 200, "a body of r bytes is admitted"


async def test_a_multi_rate_rule_applies_every_rate(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(config(upstream, redis_url))
    statuses = []
    for _ in range(3):
        async with session.get(proxy.url + "/multi") as resp:
            statuses.append(resp.status)
            last, doc = resp, await resp.json(content_type=None)
    assert statuses == [200, 200, 429]
    assert sf_list(last.headers["RateLimit-Policy"]) == [
        ("multi.1h", {"q": 3, "w": 3600}), ("multi.1m", {"q": 2, "w": 60})]
    assert doc["type"] == QUOTA_EXCEEDED
    assert doc["violated-policies"] == ["multi.1m"]
    assert usage(redis_url, Rule("multi.1h", 3, 3600)) == 2


async def test_fixed_costs_count_requests_and_r_is_always_admissible(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(config(upstream, redis_url))
    seen = []
    while True:
        async with session.get(proxy.url + "/costly") as resp:
            [(_, policy)] = sf_list(resp.headers["RateLimit-Policy"])
            [(_, current)] = sf_list(resp.headers["RateLimit"])
            seen.append((resp.status, policy["q"], current["r"]))
            if resp.status == 429:
                break
    assert seen == [(200, 3, 2), (200, 3, 1), (200, 3, 0), (429, 3, 0)], "10 units, 3 per request: 3 requests"


async def test_problem_instances_are_percent_encoded_uri_references(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(config(upstream, redis_url))
    target = proxy.url + "/api/a%20b/%C3%BC?secret=1"
    for _ in range(2):
        async with session.get(target) as resp:
            assert resp.status == 200
    async with session.get(target) as resp:
        assert resp.status == 429
        assert (await resp.json(content_type=None))["instance"] == "/api/a%20b/%C3%BC", "no query, no raw bytes"
    async with session.get(proxy.url + "/metered/%E2%82%AC%25", headers={"X-Cost": "many"}) as resp:
        assert resp.status == 400
        assert (await resp.json(content_type=None))["instance"] == "/metered/%E2%82%AC%25"


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "aiohttp"])
async def test_an_admitted_request_the_upstream_fails_still_gets_its_quota_state(
    fast_path: bool, upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    # Every upstream down: 502; a silent upstream: 504. The request was admitted and consumed quota either way.
    down = await start_proxy(proxy_config([dead_url()], redis_url=redis_url, fast_path=fast_path,
                                          rules=[{"name": "api", "limit": "5/60s"}],
                                          routes=[{"path": "/*", "limits": [{"rule": "api"}]}]))
    for remaining in (4, 3):
        async with session.get(down.url + "/orders") as resp:
            assert resp.status == 502
            assert resp.headers["Content-Type"] == "application/problem+json"
            assert sf_list(resp.headers["RateLimit-Policy"]) == [("api", {"q": 5, "w": 60})]
            [(name, current)] = sf_list(resp.headers["RateLimit"])
            assert (name, current["r"]) == ("api", remaining)
            assert "Retry-After" not in resp.headers, "admitted: there is nothing to wait for"
    silent = await start_proxy(proxy_config([upstream.url], redis_url=redis_url, fast_path=fast_path, timeout=0.3,
                                            key_prefix="silent", rules=[{"name": "api", "limit": "5/60s"}],
                                            routes=[{"path": "/*", "limits": [{"rule": "api"}]}]))
    async with session.get(silent.url + "/hang") as resp:
        assert resp.status == 504
        [(_, current)] = sf_list(resp.headers["RateLimit"])
        assert current["r"] == 4


async def test_a_request_that_can_never_pass_is_denied_without_retry_after(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(config(upstream, redis_url))
    async with session.get(proxy.url + "/metered/big", headers={"X-Cost": "11"}) as resp:  # units: 10 a minute
        assert resp.status == 429
        assert "Retry-After" not in resp.headers, "waiting never admits a cost above the limit"
        doc = await resp.json(content_type=None)
        assert (doc["type"], doc["violated-policies"], doc["retry_after"]) == (QUOTA_EXCEEDED, ["units"], None)
        assert "can never be admitted" in doc["detail"]
        [(name, current)] = sf_list(resp.headers["RateLimit"])
        assert (name, current["r"]) == ("units", 10), "and it consumed nothing"
    async with session.get(proxy.url + "/metered/big", headers={"X-Cost": "10"}) as resp:
        assert resp.status == 200, "the whole quota is still there"
    async with session.get(proxy.url + "/metered/big", headers={"X-Cost": "1"}) as resp:
        assert resp.status == 429
        assert int(resp.headers["Retry-After"]) >= 1, "an ordinary denial still says when to come back"

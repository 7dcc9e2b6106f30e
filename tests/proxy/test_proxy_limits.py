"""Rate limiting through the proxy: a real upstream app, a real Redis, in-process proxies."""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import http_sfv
import pytest
import redis

from tests.proxy.helpers import StartProxy, Upstream, metric_lines, proxy_config


def sf_list(value: str) -> list[tuple[str, dict[str, Any]]]:
    """A Structured Field List (RFC 9651) as (string item, parameters) pairs; fails if malformed."""
    parsed = http_sfv.List()
    parsed.parse(value.encode("ascii"))
    return [(item.value, dict(item.params)) for item in parsed]


def api_config(upstream: Upstream, redis_url: str, **proxy: Any) -> dict[str, Any]:
    return proxy_config(
        [upstream.url], redis_url=redis_url,
        rules=[{"name": "api", "limit": "5/10s", "resolution": 1}, {"name": "bytes", "limit": "1000/10s"},
               {"name": "watch", "limit": "2/10s"}, {"name": "units", "limit": "10/10s"}],
        routes=[
            {"path": "/api/{version}/*", "limits": [{"rule": "api", "key": "ip"}]},
            {"path": "/keyed/{x}", "limits": [{"rule": "api", "key": "header:X-API-Key+param:x"}]},
            {"path": "/upload", "methods": ["POST"], "limits": [{"rule": "bytes", "key": "ip", "cost": "body"}]},
            {"path": "/costly", "limits": [{"rule": "units", "key": "ip", "cost": "header:X-Cost"}]},
            {"path": "/shadowed", "limits": [{"rule": "watch", "key": "ip", "shadow": True}]},
            {"path": "/free/*"},
        ],
        **proxy,
    )


async def test_five_per_ten_seconds_then_429_with_structured_ratelimit_fields(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url))
    statuses, remaining = [], []
    for _ in range(5):
        async with session.get(proxy.url + "/api/v1/items?x=1") as resp:
            statuses.append(resp.status)
            assert (await resp.json())["target"] == "/api/v1/items?x=1"
            assert sf_list(resp.headers["RateLimit-Policy"]) == [("api", {"q": 5, "w": 10})]
            [(name, params)] = sf_list(resp.headers["RateLimit"])
            assert name == "api"
            assert 0 <= params["t"] <= 11, "no more than r within t: until a counted bucket leaves the window"
            remaining.append(params["r"])
            assert "Retry-After" not in resp.headers
            assert "X-RateLimit-Limit" not in resp.headers, "legacy headers are off by default"
    assert statuses == [200] * 5
    assert remaining == [4, 3, 2, 1, 0]

    async with session.get(proxy.url + "/api/v1/items") as resp:
        assert resp.status == 429
        assert resp.headers["Content-Type"] == "application/problem+json"
        retry_after = resp.headers["Retry-After"]
        assert retry_after.isdigit(), "delay-seconds"
        assert 1 <= int(retry_after) <= 11
        assert sf_list(resp.headers["RateLimit-Policy"]) == [("api", {"q": 5, "w": 10})]
        [(name, params)] = sf_list(resp.headers["RateLimit"])
        assert (name, params["r"]) == ("api", 0)
        assert params["t"] <= int(retry_after), "Retry-After never ends before the effective window"
        doc = await resp.json(content_type=None)
        assert doc["status"] == 429
        assert doc["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
        assert doc["violated-policies"] == ["api"]
        assert doc["rule"] == "api"
        assert doc["instance"] == "/api/v1/items"
        assert 0 < doc["retry_after"] <= int(retry_after)
    assert len(upstream.seen) == 5, "the denied request never reached the upstream"

    # Another client address is another bucket; paths outside the routes are not limited.
    async with session.get(proxy.url + "/free/x") as resp:
        assert resp.status == 200
        assert "RateLimit" not in resp.headers
    async with session.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        assert (await resp.json())["target"] == "/metrics", "/metrics on the proxied listener is the upstream's"
    lines = await metric_lines(session, proxy.admin_url or "", "geolimit_proxy_decisions_total")
    assert lines['geolimit_proxy_decisions_total{result="allowed",route="/api/{version}/*",rule="api"}'] == 5
    assert lines['geolimit_proxy_decisions_total{result="denied",route="/api/{version}/*",rule="api"}'] == 1
    responses = await metric_lines(session, proxy.admin_url or "", "geolimit_proxy_responses_total")
    assert responses['geolimit_proxy_responses_total{code="429",route="/api/{version}/*"}'] == 1


async def test_legacy_headers_and_keys_from_headers_and_path_params(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url, legacy_headers=True))
    for _ in range(5):
        async with session.get(proxy.url + "/keyed/a", headers={"X-API-Key": "k1"}) as resp:
            assert resp.status == 200
    async with session.get(proxy.url + "/keyed/a", headers={"X-API-Key": "k1"}) as resp:
        assert resp.status == 429
        assert (resp.headers["X-RateLimit-Limit"], resp.headers["X-RateLimit-Remaining"]) == ("5", "0")
        assert 1 <= int(resp.headers["X-RateLimit-Reset"]) <= 11
    async with session.get(proxy.url + "/keyed/a", headers={"X-API-Key": "k2"}) as resp:
        assert resp.status == 200, "another API key has its own bucket"
        assert resp.headers["X-RateLimit-Remaining"] == "4"
    async with session.get(proxy.url + "/keyed/b", headers={"X-API-Key": "k1"}) as resp:
        assert resp.status == 200, "the path parameter is part of the key"
    async with session.get(proxy.url + "/keyed/a") as resp:
        assert resp.status == 200, "no API key: the '-' bucket"
    subjects = sorted(k.decode().split(":api:", 1)[1] for k in redis_client.scan_iter("gl:*:api:*"))
    assert subjects == ["x-api-key=-|x=a", "x-api-key=k1|x=a", "x-api-key=k1|x=b", "x-api-key=k2|x=a"]


async def test_costs_from_headers_and_body_sizes(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url))
    async with session.get(proxy.url + "/costly", headers={"X-Cost": "7"}) as resp:
        assert resp.status == 200
        assert sf_list(resp.headers["RateLimit"])[0][1]["r"] == 3
    for bad in ("abc", "-2", "1.5", "9" * 30):
        async with session.get(proxy.url + "/costly", headers={"X-Cost": bad}) as resp:
            assert resp.status == 400, bad
            assert resp.headers["Content-Type"] == "application/problem+json"
            doc = await resp.json(content_type=None)
            assert doc["status"] == 400
            assert "cost" in doc["detail"]
    async with session.get(proxy.url + "/costly", headers={"X-Cost": "4"}) as resp:
        assert resp.status == 429, "the malformed costs consumed nothing: 7 + 4 > 10"
    async with session.get(proxy.url + "/costly") as resp:
        assert resp.status == 200, "no cost header costs 0"

    async with session.post(proxy.url + "/upload", data=b"x" * 600) as resp:
        assert resp.status == 200
        assert (await resp.json())["size"] == 600
    async with session.post(proxy.url + "/upload", data=b"x" * 600) as resp:
        assert resp.status == 429, "byte quota: 600 + 600 > 1000"

    async def chunked() -> Any:
        yield b"y" * 10

    async with session.post(proxy.url + "/upload", data=chunked()) as resp:
        assert resp.status == 400, "a byte quota needs a Content-Length"
        assert "Content-Length" in (await resp.json(content_type=None))["detail"]


async def test_shadow_rules_count_and_log_but_never_deny(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url))
    caplog.set_level(logging.INFO, logger="geolimit")
    for _ in range(4):
        async with session.get(proxy.url + "/shadowed") as resp:
            assert resp.status == 200
            assert "Retry-After" not in resp.headers
    lines = await metric_lines(session, proxy.admin_url or "", "geolimit_proxy_decisions_total")
    assert lines['geolimit_proxy_decisions_total{result="allowed",route="/shadowed",rule="watch"}'] == 2
    assert lines['geolimit_proxy_decisions_total{result="shadow_denied",route="/shadowed",rule="watch"}'] == 2
    assert "shadow limit watch would deny GET /shadowed" in caplog.text
    assert len(upstream.seen) == 4


@pytest.mark.parametrize("on_error", ["allow", "deny"])
async def test_unreachable_redis_fails_open_or_closed_per_rule_with_a_metric_and_a_log_line(
    upstream: Upstream, start_proxy: StartProxy, session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture, on_error: str,
) -> None:
    data = proxy_config(
        [upstream.url], redis_url="redis://127.0.0.1:1/0", decision_timeout=0.3,
        rules=[{"name": "api", "limit": "5/10s"}, {"name": "other", "limit": "5/10s"}],
        routes=[{"path": "/x", "limits": [{"rule": "api", "on_error": on_error}]},
                {"path": "/y", "limits": [{"rule": "other"}]}],
    )
    caplog.set_level(logging.WARNING, logger="geolimit")
    proxy = await start_proxy(data)
    async with session.get(proxy.url + "/x") as resp:
        if on_error == "allow":
            assert resp.status == 200
        else:
            assert resp.status == 503
            assert resp.headers["Content-Type"] == "application/problem+json"
            assert resp.headers["Retry-After"] == "1"
            assert "fail closed" in (await resp.json(content_type=None))["detail"]
    async with session.get(proxy.url + "/y") as resp:
        assert resp.status == 200, "the default is to fail open"
    lines = await metric_lines(session, proxy.admin_url or "", "geolimit_proxy_decisions_total")
    assert lines[f'geolimit_proxy_decisions_total{{result="error_{on_error}",route="/x",rule="api"}}'] == 1
    assert "rate limit storage unavailable; rule api fails " + ("open" if on_error == "allow" else "closed") in caplog.text


async def test_max_body_refuses_large_bodies_with_413(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url, max_body=100_000))
    async with session.post(proxy.url + "/echo", data=b"z" * 100_001) as resp:
        assert resp.status == 413
        assert (await resp.json(content_type=None))["status"] == 413

    async def chunked(n: int) -> Any:
        for _ in range(n):
            yield b"z" * 50_000

    async with session.post(proxy.url + "/echo", data=chunked(1)) as resp:
        assert resp.status == 200, "under the limit"
        assert len(await resp.read()) == 50_000
    async with session.post(proxy.url + "/sink", data=chunked(3)) as resp:
        assert resp.status == 413, "a chunked body is counted as it streams"
    async with session.post(proxy.url + "/echo", data=b"z" * 100_000) as resp:
        assert resp.status == 200
        assert len(await resp.read()) == 100_000


async def test_expect_100_continue_is_answered_after_the_decision(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(api_config(upstream, redis_url))
    async with session.post(proxy.url + "/upload", data=b"a" * 900, expect100=True) as resp:
        assert resp.status == 200
        assert (await resp.json())["size"] == 900
    async with session.post(proxy.url + "/upload", data=b"a" * 900, expect100=True) as resp:
        assert resp.status == 429, "denied before the client sends its body"
    assert all(s.header("Expect") is None for s in upstream.seen)
    doc = json.loads(json.dumps([s.target for s in upstream.seen]))
    assert doc == ["/upload"]

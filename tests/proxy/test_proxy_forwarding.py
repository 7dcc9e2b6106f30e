"""Forwarding: headers both ways, targets, bodies, upstream failures, malformed requests."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import aiohttp
import pytest
import redis
from multidict import CIMultiDict, CIMultiDictProxy

from geolimit.http.keys import trusted_networks
from geolimit.proxy.forwarding import forwarded_element, request_headers
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.regions import dead_url, eventually


def simple_config(upstreams: list[str], redis_url: str, **proxy: Any) -> dict[str, Any]:
    return proxy_config(
        upstreams, redis_url=redis_url, rules=[{"name": "api", "limit": "1000/10s"}],
        routes=[{"path": "/limited/*", "limits": [{"rule": "api", "key": "ip"}]},
                {"path": "/keyed", "limits": [{"rule": "api", "key": "header:X-API-Key"}]}],
        **proxy,
    )


def test_forwarded_elements_quote_ipv6_and_hosts_with_ports() -> None:
    assert forwarded_element("192.0.2.1", "http", "example.com") == "for=192.0.2.1;proto=http;host=example.com"
    assert forwarded_element("2001:db8::17", "https", "example.com:8443") == (
        'for="[2001:db8::17]";proto=https;host="example.com:8443"')
    assert forwarded_element(None, "http", None) == "for=unknown;proto=http"
    assert forwarded_element("fe80::1%eth0", "http", 'we"ird') == 'for="[fe80::1]";proto=http;host="we\\"ird"'
    incoming = CIMultiDictProxy(CIMultiDict([
        ("Host", "front.example"), ("X-Forwarded-For", "198.51.100.1"), ("X-Forwarded-For", "203.0.113.9"),
        ("Forwarded", "for=198.51.100.1"), ("Forwarded", 'for="[2001:db8::1]"'), ("X-Forwarded-Proto", "https"),
        ("Connection", "close, X-Drop"), ("X-Drop", "1"), ("Content-Length", "5"),
    ]))
    trusted = trusted_networks(["10.0.0.0/8"])
    out = request_headers(incoming, peer="10.1.2.3", scheme="http", trusted=trusted, upstream_host="up:9000",
                          content_length=5)
    assert out["Host"] == "up:9000"
    assert out["X-Forwarded-For"] == "198.51.100.1, 203.0.113.9, 10.1.2.3"
    assert out["Forwarded"] == 'for=198.51.100.1, for="[2001:db8::1]", for=10.1.2.3;proto=http;host=front.example'
    assert out["X-Forwarded-Proto"] == "https"
    assert out["X-Forwarded-Host"] == "front.example"
    assert "X-Drop" not in out
    assert "Connection" not in out
    assert out.getall("Content-Length") == ["5"]
    untrusted = request_headers(incoming, peer="2001:db8::9", scheme="http", trusted=trusted, upstream_host=None,
                                content_length=None)
    assert untrusted["Host"] == "front.example"
    assert untrusted["X-Forwarded-For"] == "2001:db8::9"
    assert untrusted["Forwarded"] == 'for="[2001:db8::9]";proto=http;host=front.example'
    assert untrusted["X-Forwarded-Proto"] == "http"
    assert "Content-Length" not in untrusted


async def test_untrusted_clients_cannot_spoof_forwarding_headers(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url))
    port = proxy.url.rsplit(":", 1)[1]
    spoof = {"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6;proto=https", "X-Forwarded-Host": "evil",
             "X-Forwarded-Proto": "https"}
    async with session.get(proxy.url + "/limited/a", headers=spoof) as resp:
        assert resp.status == 200
    seen = upstream.seen[-1]
    assert seen.header("X-Forwarded-For") == "127.0.0.1"
    assert seen.header("Forwarded") == f'for=127.0.0.1;proto=http;host="127.0.0.1:{port}"'
    assert seen.header("X-Forwarded-Proto") == "http"
    assert seen.header("X-Forwarded-Host") == f"127.0.0.1:{port}"
    assert seen.header("Host") == upstream.url.removeprefix("http://"), "Host is the upstream's by default"
    assert [k.decode().split(":api:", 1)[1] for k in redis_client.scan_iter("gl:*:api:*")] == ["ip=127.0.0.1"]


async def test_trusted_proxies_chains_are_extended_and_their_client_is_limited(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url, trusted_proxies=["127.0.0.0/8"],
                                            preserve_host=True))
    headers = CIMultiDict([("Host", "api.example"), ("X-Forwarded-For", "198.51.100.1"),
                           ("X-Forwarded-For", "203.0.113.9"), ("Forwarded", "for=203.0.113.9;proto=https"),
                           ("X-Forwarded-Proto", "https")])
    async with session.get(proxy.url + "/limited/a", headers=headers) as resp:
        assert resp.status == 200
    seen = upstream.seen[-1]
    assert seen.header("Host") == "api.example", "preserve_host keeps the client's Host"
    assert seen.header("X-Forwarded-For") == "198.51.100.1, 203.0.113.9, 127.0.0.1"
    assert seen.header("Forwarded") == "for=203.0.113.9;proto=https, for=127.0.0.1;proto=http;host=api.example"
    assert seen.header("X-Forwarded-Proto") == "https"
    assert seen.header("X-Forwarded-Host") == "api.example"
    assert [k.decode().split(":api:", 1)[1] for k in redis_client.scan_iter("gl:*:api:*")] == ["ip=203.0.113.9"]


async def test_hop_by_hop_headers_stay_on_their_hop_and_targets_pass_unchanged(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url))
    headers = {"Connection": "keep-alive, X-Secret", "X-Secret": "s", "Keep-Alive": "timeout=5", "TE": "trailers",
               "Proxy-Authorization": "Basic eA==", "Trailer": "X-T", "X-Kept": "yes"}
    async with session.get(proxy.url + "/a%2Fb/c?x=%20y&x=2&empty", headers=headers) as resp:
        assert resp.status == 200
    seen = upstream.seen[-1]
    assert seen.target == "/a%2Fb/c?x=%20y&x=2&empty"
    names = {k.lower() for k, _ in seen.headers}
    assert not names & {"x-secret", "keep-alive", "te", "proxy-authorization", "trailer"}
    assert seen.header("X-Kept") == "yes"

    async with session.get(proxy.url + "/status/201") as resp:
        assert resp.status == 201
        assert resp.headers.getall("Set-Cookie") == ["a=1; Path=/", "b=2; Path=/"]
        assert resp.headers["X-End"] == "kept"
        assert "X-Hop" not in resp.headers, "named in the upstream's Connection header"
        assert "Keep-Alive" not in resp.headers
        assert await resp.text() == "status body"
    for code in (204, 304):
        async with session.get(proxy.url + f"/status/{code}") as resp:
            assert resp.status == code
            assert await resp.read() == b""
    async with session.head(proxy.url + "/download/123456") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == "123456", "HEAD keeps the upstream's length"
    async with session.get(proxy.url + "/gzip") as resp:
        assert resp.headers["Content-Encoding"] == "gzip", "bodies pass encoded, never decompressed"
        assert gzip.decompress(await resp.read()) == b"hello " * 100
    async with session.get(proxy.url + "/download/3000000") as resp:
        assert resp.headers["Content-Length"] == "3000000"
        assert len(await resp.read()) == 3_000_000


async def test_upstream_timeout_gives_504_and_unreachable_upstreams_502(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url, timeout=0.3))
    started = asyncio.get_running_loop().time()
    async with session.get(proxy.url + "/hang") as resp:
        assert resp.status == 504
        assert resp.headers["Content-Type"] == "application/problem+json"
        doc = await resp.json(content_type=None)
        assert (doc["status"], doc["title"]) == (504, "Gateway Timeout")
    assert asyncio.get_running_loop().time() - started < 5
    async with session.get(proxy.url + "/limited/after-timeout") as resp:
        assert resp.status == 200, "the proxy carries on"

    down = await start_proxy(simple_config([dead_url()], redis_url))
    async with session.get(down.url + "/x") as resp:
        assert resp.status == 502
        assert (await resp.json(content_type=None))["title"] == "Bad Gateway"
    async with session.get((down.admin_url or "") + "/metrics") as resp:
        text = await resp.text()
    assert 'geolimit_proxy_upstream_errors_total{kind="connect"' in text


async def test_connect_failures_retry_the_next_upstream_for_idempotent_requests_only(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    second = await Upstream("second").start()
    try:
        proxy = await start_proxy(simple_config([dead_url(), upstream.url, second.url], redis_url))
        served = []
        for _ in range(6):
            async with session.get(proxy.url + "/x") as resp:
                assert resp.status == 200
                served.append(resp.headers["X-Upstream"])
        assert sorted(set(served)) == ["second", "up"], "round robin over the live upstreams"
        statuses = []
        for _ in range(3):
            async with session.post(proxy.url + "/x", data=b"payload") as resp:
                statuses.append(resp.status)
        assert sorted(statuses) == [200, 200, 502], "a POST is never retried"
        no_retry = await start_proxy(simple_config([dead_url(), upstream.url], redis_url, retry_connect=False))
        statuses = []
        for _ in range(2):
            async with session.get(no_retry.url + "/x") as resp:
                statuses.append(resp.status)
        assert sorted(statuses) == [200, 502]
    finally:
        await second.stop()


async def test_an_upstream_breaking_off_mid_body_aborts_the_client_connection(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url))
    async with session.get(proxy.url + "/broken") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    async with session.get(proxy.url + "/limited/ok") as resp:
        assert resp.status == 200


async def raw_exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1."), response[:200]
    return int(response.split(b" ", 2)[1])


async def test_malformed_and_duplicated_headers_never_cause_a_500(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url, trusted_proxies=["127.0.0.1"]))

    def request(path: str, *headers: bytes) -> bytes:
        return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + b"".join(
            h + b"\r\n" for h in headers) + b"\r\n"

    forwarded_cases = [
        (b"X-Forwarded-For: ,,,garbage, [::1, 999.1.1.1,",),
        (b"X-Forwarded-For: 198.51.100.7", b"X-Forwarded-For: 203.0.113.7"),
        (b'Forwarded: for="[2001:db8::1', b"Forwarded: ;;;=,,\"", b"X-Forwarded-For: 198.51.100.8"),
        (b"Forwarded: for=unknown;proto=https;by=_hidden", b"Forwarded: for=_obfuscated"),
        (b"Forwarded: " + b"for=192.0.2.1, " * 200,),
    ]
    for headers in forwarded_cases:
        response = await raw_exchange(proxy.url, request("/limited/f", *headers))
        assert status_of(response) == 200, (headers, response[:300])
    assert all("127.0.0.1" in (s.header("X-Forwarded-For") or "") for s in upstream.seen)

    keyed_cases = [
        (b"X-API-Key: \xff\xfe\x80 not utf-8",),
        (b"X-API-Key: " + b"k" * 6000,),
        (b"X-API-Key: a", b"X-API-Key: b"),
    ]
    for headers in keyed_cases:
        response = await raw_exchange(proxy.url, request("/keyed", *headers))
        assert status_of(response) == 200, (headers, response[:300])

    refused_by_the_parser = [
        request("/x", b"Content-Length: abc"),
        request("/x", b"No colon here"),
        request("/x", b"Content-Length: 5", b"Content-Length: 6"),
        request("/x", b"X-Bad: a\x00b"),
        request("/keyed", b"X-API-Key: \x7f"),
        b"GET /x HTTP/1.1\r\nHost: t\r\n folded: line\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # TLS to a plain-HTTP port
    ]
    for raw in refused_by_the_parser:
        response = await raw_exchange(proxy.url, raw)
        assert response == b"" or 400 <= status_of(response) < 500, (raw, response[:300])
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/limited/still-fine") as resp:
        assert resp.status == 200


async def test_a_client_going_away_cancels_its_upstream_exchange(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(simple_config([upstream.url], redis_url))
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    await eventually(lambda: proxy.metrics.in_flight == 1 and any(s.target == "/hang" for s in upstream.seen),
                     what="the request to reach the upstream")
    writer.close()
    await eventually(lambda: proxy.metrics.in_flight == 0, timeout=5,
                     what="the proxy to drop the exchange (its upstream timeout is 30 s)")

"""The proxy's aiohttp listeners bound request heads as the agent's do (geolimit/http/connections.py).

The fast path had its own head deadline (30 s), but the connections it hands to aiohttp
(a head over 16 KiB, anything it does not parse), the listener with ``fast_path =
false`` and the admin listener had none: half a head was held for aiohttp's
keepalive_timeout (3630 s). Each now gets the fast path's HEAD_TIMEOUT.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import uvloop

import geolimit.proxy.fast_server as fast_server
import geolimit.proxy.server as proxy_server
from tests.proxy.helpers import StartProxy, Upstream, proxy_config

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """asyncio's loop, and uvloop: the agent's and the proxy's loop when they run as processes."""
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


#: Over the fast path's 16 KiB, every line under aiohttp's 8190 bytes, never finished.
LONG_HEAD = b"GET /x HTTP/1.1\r\nHost: t\r\nX-A: " + b"a" * 8000 + b"\r\nX-B: " + b"b" * 8000 + b"\r\nX-C: " + b"c" * 1000


def config(upstream: str, redis_url: str, **proxy: Any) -> dict[str, Any]:
    return proxy_config([upstream], redis_url=redis_url, rules=[{"name": "api", "limit": "2/10s"}],
                        routes=[{"path": "/limited/*", "limits": [{"rule": "api", "key": "ip"}]}], **proxy)


async def _until_closed(url: str, sent: bytes) -> tuple[bytes, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    started = asyncio.get_running_loop().time()
    try:
        writer.write(sent)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return data, asyncio.get_running_loop().time() - started


async def test_every_aiohttp_listener_closes_a_half_sent_head_at_the_deadline(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy_server, "HEAD_TIMEOUT", 0.3)
    fast = await start_proxy(config(upstream.url, redis_url, key_prefix="fast"))
    slow = await start_proxy(config(upstream.url, redis_url, key_prefix="slow", fast_path=False))
    assert fast._fast is not None
    assert slow._fast is None
    assert fast.admin_url
    assert slow.admin_url
    cases = {"fast path, handed to aiohttp": (fast.url, LONG_HEAD), "fast_path = false": (slow.url, b"GET /limi"),
             "admin": (fast.admin_url, b"GET /metr"), "admin, fast_path = false": (slow.admin_url, b"GET /he")}
    closed = await asyncio.gather(*(_until_closed(url, sent) for url, sent in cases.values()))
    for what, (data, seconds) in zip(cases, closed, strict=True):
        assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), (what, data[:100])
        assert 0.25 < seconds < 5, (what, seconds)
    assert fast._fast.handed_off == 1
    for proxy in (fast, slow):
        assert proxy.metrics.connections_dropped == {("listen", "head_timeout"): 1, ("admin_listen", "head_timeout"): 1}
        assert b'geolimit_proxy_connections_dropped_total{listener="listen",reason="head_timeout"} 1.0' in \
            proxy.metrics.render()
    assert not [seen for seen in upstream.seen if seen.target in ("/x", "/limi")]


async def test_the_fast_path_s_own_connections_count_against_the_cap(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cap held only the connections the fast path handed to aiohttp: with RLIMIT_NOFILE 1024, 2000
    idle connections pinned a proxy at 1024 descriptors and failed every request."""
    monkeypatch.setattr(proxy_server, "default_max_connections", lambda listeners=1: 4)
    proxy = await start_proxy(config(upstream.url, redis_url, key_prefix="cap"))
    assert proxy._fast is not None
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    chunked = await asyncio.open_connection(host, int(port))  # the 4th place, then handed to aiohttp
    excess = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
    for reader, writer in excess:  # closed at their accept
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    assert proxy.metrics.connections_dropped == {("listen", "connection_limit"): 20}
    reader, writer = chunked
    writer.write(b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 5)
    assert status == b"HTTP/1.1 200 OK\r\n", "its place went with it to aiohttp"
    assert proxy._fast.handed_off == 1
    writer.close()
    held[0][1].close()  # now two places are free: the fast path's and aiohttp's gave theirs back
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while await _status(proxy.url) != b"HTTP/1.1 200 OK":
        assert loop.time() < deadline, "no place given back"
        await asyncio.sleep(0.01)
    assert list(await asyncio.gather(_status(proxy.url), _status(proxy.url))) == [b"HTTP/1.1 200 OK"] * 2
    assert await _status(proxy.url) == b"HTTP/1.1 200 OK"
    for _, w in held[1:]:
        w.close()


async def _status(url: str) -> bytes:
    """The status line of a GET on a new connection (empty: closed at its accept)."""
    data, _ = await _until_closed(url, b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    return data.split(b"\r\n", 1)[0]


async def test_a_fast_path_connection_that_sends_nothing_is_closed_at_the_head_deadline(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It was held for the keep-alive timeout (75 s) from its accept, where the agent's listeners close
    it at their head deadline; an answered connection still idles for the keep-alive timeout."""
    monkeypatch.setattr(fast_server, "HEAD_TIMEOUT", 0.3)
    fast = await start_proxy(config(upstream.url, redis_url, key_prefix="silent"))
    assert fast._fast is not None
    data, seconds = await _until_closed(fast.url, b"")
    assert data == b""
    assert 0.25 < seconds < 5
    host, port = fast.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /free HTTP/1.1\r\nHost: t\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), 10)
        assert status.startswith(b"HTTP/1.1 200 "), status
        with pytest.raises(asyncio.TimeoutError):  # kept alive well past the head deadline
            await asyncio.wait_for(reader.read(), 1.0)
    finally:
        writer.close()

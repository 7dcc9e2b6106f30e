"""The fast path (geolimit/proxy/fast_server.py) with real upstreams on loopback and a real Redis.

The same answers as aiohttp's path; keep-alive and pipelining; pooled upstream
connections (a stale one retried); chunked, close-delimited and interim upstream
answers; bad input from either side ends in a 4xx, a 502 or a closed connection,
never a 500 or a hang. Every test runs on asyncio's loop and on uvloop (the
proxy's loop when it runs as a process).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import redis
import uvloop

from geolimit.proxy import Proxy, fast_server
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.regions import eventually

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")

Answer = Callable[[int, bytes], "tuple[bytes, bool] | None"]  # (request number, head) -> (reply, close after)


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    if request.param == "uvloop":
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


class Scripted:
    """A raw HTTP/1.1 upstream: ``answer(n, head)`` gives the bytes for request ``n`` (None: close, no answer)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                self.requests.append(head)
                reply = self.answer(len(self.requests), head)
                if reply is None:
                    break
                writer.write(reply[0])
                await writer.drain()
                if reply[1]:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Answer], Any]]:
    servers: list[Scripted] = []

    async def start(answer: Answer) -> Scripted:
        server = await Scripted(answer).start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()


def config(upstreams: list[str], redis_url: str, **proxy: Any) -> dict[str, Any]:
    return proxy_config(upstreams, redis_url=redis_url, rules=[{"name": "api", "limit": "2/10s"}],
                        routes=[{"path": "/limited/*", "limits": [{"rule": "api", "key": "ip"}]}], **proxy)


def ok(body: bytes = b"hello", extra: bytes = b"") -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body), False


async def exchange(url: str, raw: bytes, timeout: float = 10) -> bytes:
    """Send ``raw`` and read until the proxy closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def responses(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """The ``(status, head, body)`` of each response in ``raw`` (Content-Length or chunked)."""
    out = []
    while raw:
        end = raw.index(b"\r\n\r\n") + 4
        head, raw = raw[:end], raw[end:]
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            body = b""
            while True:
                line_end = raw.index(b"\r\n")
                size = int(raw[:line_end], 16)
                body += raw[line_end + 2:line_end + 2 + size]
                raw = raw[line_end + 4 + size:]
                if not size:
                    break
        else:
            length = int(lower.split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length" in lower else 0
            body, raw = raw[:length], raw[length:]
        out.append((int(head.split(b" ", 2)[1]), head, body))
    return out


def statuses(raw: bytes) -> list[int]:
    return [status for status, _, _ in responses(raw)]


async def test_the_fast_path_answers_as_aiohttp_s_path(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    fast = await start_proxy(config([upstream.url], redis_url, key_prefix="fast"))
    slow = await start_proxy(config([upstream.url], redis_url, key_prefix="slow", fast_path=False))
    assert fast._fast is not None
    assert slow._fast is None
    requests: list[tuple[str, str, bytes | None]] = [
        ("GET", "/limited/a", None), ("GET", "/limited/a", None), ("GET", "/limited/a?x=1", None),
        ("GET", "/status/404", None), ("HEAD", "/download/10", None), ("GET", "/status/204", None),
        ("POST", "/upload", b"x" * 1000), ("GET", "/gzip", None), ("GET", "/download/300000", None),
        ("DELETE", "/status/500", None), ("GET", "/a%20b/%7Ec?q=%41", None),
    ]
    answers: dict[Proxy, list[tuple[int, list[str], dict[str, str], bytes]]] = {fast: [], slow: []}
    waits: dict[Proxy, int] = {}
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for proxy in (fast, slow):
            for method, path, body in requests:
                async with session.request(method, proxy.url + path, data=body) as resp:
                    names = sorted({k.lower() for k in resp.headers if k.lower() not in ("date", "ratelimit")})
                    if resp.status == 429:
                        waits[proxy] = int(resp.headers["Retry-After"])
                    kept = {k: resp.headers[k] for k in ("Content-Type", "Content-Length", "Retry-After",
                                                          "RateLimit-Policy", "Content-Encoding", "X-End")
                            if k in resp.headers}
                    if resp.status == 429:  # its body holds times, which may differ by a digit
                        kept.pop("Content-Length")
                        # The two proxies' 429s come some ms apart: their waits may straddle a second.
                        kept["Retry-After"] = str(int(int(kept["Retry-After"]) >= 1))
                    answers[proxy].append((resp.status, names, kept, await resp.read()))
    for (path_fast, path_slow, request) in zip(answers[fast], answers[slow], requests, strict=True):
        assert path_fast[:3] == path_slow[:3], request
        if path_fast[0] == 429:
            assert json.loads(path_fast[3]).keys() == json.loads(path_slow[3]).keys()
            assert abs(waits[fast] - waits[slow]) <= 1
        elif request[1] != "/upload":
            fast_body, slow_body = path_fast[3], path_slow[3]
            if fast_body.startswith(b"{"):  # the upstream's echo: the headers it received
                fast_doc, slow_doc = json.loads(fast_body), json.loads(slow_body)
                assert fast_doc["target"] == slow_doc["target"]
                fast_names = {k.lower() for k, _ in fast_doc["headers"]}
                assert fast_names == {k.lower() for k, _ in slow_doc["headers"]}
            else:
                assert fast_body == slow_body, request
    assert [a[0] for a in answers[fast]][:3] == [200, 200, 429]
    assert fast._fast.served >= len(requests)
    assert fast.metrics.responses[("/limited/*", 429)] == 1


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(config([upstream.url], redis_url))
    raw = b"".join(b"GET /%b HTTP/1.1\r\nHost: t\r\n\r\n" % name for name in (b"one", b"two"))
    raw += b"POST /three HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
    response = await exchange(proxy.url, raw)
    assert statuses(response) == [200, 200, 200]
    assert [s.target for s in upstream.seen] == ["/one", "/two", "/three"]
    assert upstream.seen[-1].body == 3
    assert response.count(b"Connection: close") == 1


async def test_upstream_connections_are_pooled_and_a_stale_one_is_retried_for_idempotent_requests(
    scripted: Callable[[Answer], Any], redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    drop = {3, 6}  # the upstream closes these requests' connections without answering

    def answer(n: int, head: bytes) -> tuple[bytes, bool] | None:
        return None if n in drop else ok(b"n=%d" % n)

    server = await scripted(answer)
    proxy = await start_proxy(config([server.url], redis_url))
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.get(proxy.url + "/x") as resp:
                assert resp.status == 200
        assert server.connections == 1, "one pooled connection for sequential requests"
        async with session.get(proxy.url + "/x") as resp:  # request 3 is dropped, 4 answers it
            assert (resp.status, await resp.read()) == (200, b"n=4")
        assert server.connections == 2
        async with session.get(proxy.url + "/x") as resp:
            assert resp.status == 200
        async with session.post(proxy.url + "/x", data=b"once") as resp:  # request 6: not retried
            assert resp.status == 502
            assert resp.headers["Content-Type"] == "application/problem+json"
    assert proxy.metrics.upstream_errors[(server.url, "protocol")] == 1


async def test_chunked_close_delimited_and_interim_upstream_answers_are_relayed(
    scripted: Callable[[Answer], Any], redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    big = bytes(range(256)) * 1200
    replies = {
        "/chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Kept: 1\r\n\r\n"
                     b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: dropped\r\n\r\n", False),
        "/close": (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", True),
        "/interim": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                     b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", False),
        "/big": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(big), big), False),
        "/big-chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                         % (len(big), big), False),
    }

    def answer(n: int, head: bytes) -> tuple[bytes, bool] | None:
        return replies[head.split(b" ")[1].decode()]

    server = await scripted(answer)
    proxy = await start_proxy(config([server.url], redis_url))
    async with aiohttp.ClientSession() as session:
        for path, status, body in [("/chunked", 200, b"hello world"), ("/close", 200, b"until the end"),
                                   ("/interim", 201, b"ok"), ("/big", 200, big), ("/big-chunked", 200, big),
                                   ("/chunked", 200, b"hello world")]:
            async with session.get(proxy.url + path) as resp:
                assert (resp.status, await resp.read()) == (status, body), path
                assert "X-Trailer" not in resp.headers
    raw = await exchange(proxy.url, b"GET /chunked HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert b"Transfer-Encoding: chunked\r\n" in raw
    assert b"X-Kept: 1\r\n" in raw
    assert raw.endswith(b"0\r\n\r\n")


async def test_bad_upstream_answers_are_502_before_the_head_and_an_aborted_connection_after(
    scripted: Callable[[Answer], Any], redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    replies: dict[str, tuple[bytes, bool] | None] = {
        "/garbage": (b"SPDY/3 200 OK\r\n\r\n", True),
        "/lengths": (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", True),
        "/control": (b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\nContent-Length: 0\r\n\r\n", True),
        "/folded": (b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n", True),
        "/short": (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly this", True),
        "/switch": (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", True),
        "/silent": None,
        "/bad-chunk": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n", True),
        "/ok": ok(),
    }

    def answer(n: int, head: bytes) -> tuple[bytes, bool] | None:
        return replies[head.split(b" ")[1].decode()]

    server = await scripted(answer)
    proxy = await start_proxy(config([server.url], redis_url))
    async with aiohttp.ClientSession() as session:
        for path in ("/garbage", "/lengths", "/control", "/folded", "/short", "/switch", "/silent"):
            async with session.post(proxy.url + path) as resp:  # POST: never retried
                assert resp.status == 502, path
                assert (await resp.json(content_type=None))["status"] == 502
        async with session.get(proxy.url + "/bad-chunk") as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        async with session.get(proxy.url + "/ok") as resp:
            assert (resp.status, await resp.read()) == (200, b"hello")
    assert proxy.metrics.upstream_errors[(server.url, "body_aborted")] == 1


async def test_bad_requests_get_a_4xx_or_a_closed_connection_and_odd_ones_are_still_served(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(config([upstream.url], redis_url))
    refused = [
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: t\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n",
        b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(2000)) + b"\r\n",
        b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /x HTTP/1.1\nHost: t\n\n",
        b"GET /a\x00b HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
        b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: t\r\n\r\n",
    ]
    for raw in refused:
        response = await exchange(proxy.url, raw)
        assert response == b"" or 400 <= statuses(response)[0] < 500, (raw[:60], response[:200])
    served = [
        b"GET /old HTTP/1.0\r\n\r\n",
        b"GET http://example.com/absolute?q=1 HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n",
        b"GET /cafe HTTP/1.1\r\nHost: t\r\nX-Name: caf\xc3\xa9\r\nConnection: close\r\n\r\n",
    ]
    for raw in served:
        response = await exchange(proxy.url, raw)
        assert statuses(response)[:1] == [200], (raw[:60], response[:200])
    assert (upstream.seen[-2].target, upstream.seen[-2].body) == ("/upload", 5)
    assert upstream.seen[-3].target == "/absolute?q=1"
    assert proxy._fast is not None
    assert proxy._fast.handed_off >= len(served)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/limited/fine") as resp:
        assert resp.status == 200


async def test_slow_and_partial_requests_are_cut_with_408(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fast_server, "HEAD_TIMEOUT", 1.0)
    proxy = await start_proxy(config([upstream.url], redis_url))
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    for parts in ([b"GET /limited/x HTTP/1.1\r\nHost: t\r\n"],
                  [b"G", b"E", b"T", b" /x", b" HTTP/1.1\r\n", b"Host: t\r\n"],
                  [b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc"]):
        reader, writer = await asyncio.open_connection(host, int(port))
        started = asyncio.get_running_loop().time()
        try:
            for part in parts:  # a slow drip does not extend the time
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.1)
            response = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        assert statuses(response) == [408], response[:200]
        assert 0.9 < asyncio.get_running_loop().time() - started < 3
    assert not [s for s in upstream.seen if s.target in ("/limited/x", "/upload")]


async def test_a_client_leaving_mid_stream_frees_its_upstream_connection(
    upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy(config([upstream.url], redis_url))
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /download/200000000 HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    assert (await reader.readexactly(12)) == b"HTTP/1.1 200"
    await reader.readexactly(1_000_000)
    assert proxy.metrics.in_flight == 1
    writer.close()
    await eventually(lambda: proxy.metrics.in_flight == 0, timeout=5, what="the exchange to be dropped")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/download/10") as resp:
        assert (resp.status, len(await resp.read())) == (200, 10)


async def test_a_small_body_sent_slowly_but_steadily_is_not_cut_off(
    upstream: Upstream, redis_url: str, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body the fast path reads itself (up to 64 KiB) earns a second per KiB received, as
    on aiohttp's path: 16 KiB at 8 KiB/s takes 2 s through a 0.5 s deadline. It got 408 at
    0.5 s before (with the default 30 s: any small upload slower than about 2 KiB/s)."""
    monkeypatch.setattr(fast_server, "HEAD_TIMEOUT", 0.5)
    proxy = await start_proxy(config([upstream.url], redis_url))
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 16384\r\n\r\n")
        for _ in range(16):
            writer.write(b"x" * 1024)
            await writer.drain()
            await asyncio.sleep(0.125)
        response = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()
    assert statuses(response) == [200], response[:200]
    assert (upstream.seen[-1].target, upstream.seen[-1].body) == ("/upload", 16384)

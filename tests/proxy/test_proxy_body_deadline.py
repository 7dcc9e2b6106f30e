"""The proxy's aiohttp path (chunked and large uploads): a request body must arrive within ``body_timeout``.

A client trickling a chunked body used to keep its upstream connection, and the
proxy's memory for it, for ever. Real proxy, real upstreams on loopback (the test
helpers' app, or a raw socket server that counts its connections), and a real
client socket that trickles.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from geolimit.proxy import Proxy
from tests.proxy.helpers import StartProxy, Upstream, proxy_config

HEAD = b"POST /upload HTTP/1.1\r\nHost: app\r\nTransfer-Encoding: chunked\r\n\r\n"


class RawUpstream:
    """An upstream that reads whatever comes and never answers; it counts its open connections."""

    def __init__(self) -> None:
        self.open = 0
        self.received = 0
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while data := await reader.read(65536):
                self.received += len(data)
        except ConnectionError:
            pass
        finally:
            self.open -= 1
            self.closed.set()
            writer.close()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    up = await RawUpstream().start()
    try:
        yield up
    finally:
        assert up.server is not None
        up.server.close()


async def start(start_proxy: StartProxy, url: str, redis_url: str, **proxy: Any) -> Proxy:
    return await start_proxy(proxy_config([url], redis_url=redis_url, rules=[{"name": "bodies", "limit": "1000/1h"}],
                                          **proxy))


async def trickle(writer: asyncio.StreamWriter, every: float = 0.05, most: int = 400) -> None:
    """One byte of chunked body every ``every`` s, at most ``most`` times (20 s), until the proxy closes."""
    for _ in range(most):
        writer.write(b"1\r\na\r\n")
        try:
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(every)  # the pace of a slow sender, not a wait for the proxy


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The status line and everything after it, up to the proxy's close (10 s at most)."""
    data = await asyncio.wait_for(reader.read(), 10)
    status, _, rest = data.partition(b"\r\n")
    return status, rest


async def test_a_trickled_chunked_body_gets_408_and_its_upstream_connection_is_closed(
    start_proxy: StartProxy, raw_upstream: RawUpstream, redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await start(start_proxy, raw_upstream.url, redis_url, body_timeout="1s")
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(HEAD)
    sender = asyncio.ensure_future(trickle(writer))
    try:
        status, rest = await answer(reader)
        elapsed = loop.time() - started
        assert status == b"HTTP/1.1 408 Request Timeout", status + rest
        assert b"the request body did not arrive within 1s" in rest
        assert b"Connection: close" in rest
        assert 1.0 <= elapsed < 5, elapsed
        await asyncio.wait_for(raw_upstream.closed.wait(), 10)
        assert raw_upstream.open == 0, "the upstream's connection was closed, not kept"
        assert raw_upstream.received > len(HEAD), "the body was streamed to the upstream meanwhile"
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, "a late body is no error of the proxy (aiohttp's 'Unhandled exception' once)"
    finally:
        sender.cancel()
        writer.close()


async def test_a_small_body_that_stops_short_gets_408(
    start_proxy: StartProxy, raw_upstream: RawUpstream, redis_url: str,
) -> None:
    """A declared body of at most 64 KiB is read whole before any upstream is asked: 50 of 100 bytes, then
    nothing, was held for ever."""
    proxy = await start(start_proxy, raw_upstream.url, redis_url, body_timeout="0.5s", fast_path=False)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /upload HTTP/1.1\r\nHost: app\r\nContent-Length: 100\r\n\r\n" + b"x" * 50)
        status, rest = await answer(reader)
        assert status == b"HTTP/1.1 408 Request Timeout", status + rest
        assert raw_upstream.received == 0, "no upstream was asked"
    finally:
        writer.close()


async def test_an_upload_that_keeps_moving_outlasts_the_deadline(
    start_proxy: StartProxy, upstream: Upstream, redis_url: str, session: aiohttp.ClientSession,
) -> None:
    """0.5 s for the body, plus a second per KiB received: 1.2 MB over about 1 s arrives whole."""
    proxy = await start(start_proxy, upstream.url, redis_url, body_timeout="0.5s")
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def paced() -> AsyncIterator[bytes]:
        for _ in range(40):
            yield b"z" * 30_000
            await asyncio.sleep(0.025)  # the pace of the upload

    async with session.post(proxy.url + "/upload", data=paced()) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["size"] == 1_200_000
    assert loop.time() - started > 0.5, "it did outlast body_timeout"


@pytest.mark.parametrize("fast_path", [True, False], ids=["handed_off", "aiohttp_only"])
async def test_a_slow_but_steady_upload_is_not_cut_off(
    start_proxy: StartProxy, upstream: Upstream, redis_url: str, session: aiohttp.ClientSession, fast_path: bool,
) -> None:
    """16 KiB/s (a 128 kbit/s uplink) for 3 s with 0.5 s of body_timeout. Each 64 KiB bought one more second,
    so an upload slower than 64 KiB/s (512 kbit/s) got 408 once its credit ran out: here after 0.7 s; with
    the default 30 s, a 2.5 MB photo from a 256 kbit/s phone after 60 s. Each KiB buys one now."""
    proxy = await start(start_proxy, upstream.url, redis_url, body_timeout="0.5s", fast_path=fast_path)
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def steady() -> AsyncIterator[bytes]:
        for _ in range(30):
            yield b"s" * 1638
            await asyncio.sleep(0.1)  # the pace of the uplink

    async with session.post(proxy.url + "/upload", data=steady()) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["size"] == 30 * 1638
    assert loop.time() - started > 2.9, "it did outlast body_timeout six times over"

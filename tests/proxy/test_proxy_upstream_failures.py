"""Failing upstreams under load: every request gets its 502 or 504 and is counted, the log
gets one line per upstream and kind every 10 s (geolimit/proxy/failures.py).

Real proxies (the fast path and aiohttp's), real Redis, and real upstreams on
loopback: a port where nothing listens, one that accepts and closes at once, one
that never answers, and the tests' aiohttp app (``/hang``, ``/broken``). The log's
clock is injected (``proxy.forwarder.failures.lines.clock``) to cross the 10 s.
Every test runs on asyncio's loop and on uvloop (the proxy's loop as a process: there
the fast path failed a request to an upstream that had closed since the connect
with a traceback and no answer).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import redis
import uvloop

from geolimit.proxy import Proxy
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.regions import dead_url, eventually

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


class Raw:
    """A raw upstream on loopback: ``closed`` accepts each connection and closes it at once,
    ``silent`` reads requests and never answers."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Raw:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=512)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.kind == "closed":
            writer.transport.abort()
            return
        self._writers.append(writer)
        while await reader.read(65536):
            pass


class Resetting:
    """An upstream on loopback that accepts each connection and resets it at once, in a thread of its
    own: in parallel with the proxy, as an upstream process is (a reset may come between the proxy's
    connect and its write)."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)  # accept() returns at once
        self._thread.join(5)
        self._sock.close()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()


@pytest.fixture
async def failing() -> AsyncIterator[Callable[[str], Awaitable[str]]]:
    """``url = await failing(kind)``: ``refused`` (nothing listens), ``closed``, ``silent`` (:class:`Raw`)
    or ``resetting`` (:class:`Resetting`)."""
    servers: list[Raw | Resetting] = []

    async def start(kind: str) -> str:
        if kind == "refused":
            return dead_url()
        server = Resetting() if kind == "resetting" else await Raw(kind).start()
        servers.append(server)
        return server.url

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def config(upstreams: list[str], redis_url: str, fast_path: bool, timeout: float = 0.3) -> dict[str, Any]:
    return proxy_config(upstreams, redis_url=redis_url, rules=[{"name": "api", "limit": "100000/10s"}],
                        routes=[{"path": "/*", "limits": [{"rule": "api", "key": "ip"}]}],
                        fast_path=fast_path, timeout=timeout)


def frozen_clock(proxy: Proxy) -> list[float]:
    """The proxy's upstream-failure log on a clock the test moves (``now[0] += 10``)."""
    now = [1000.0]
    assert proxy.forwarder is not None
    proxy.forwarder.failures.lines.clock = lambda: now[0]
    return now


def lines(caplog: pytest.LogCaptureFixture, upstream: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "geolimit.proxy" and r.getMessage().startswith(f"upstream {upstream}: ")]


async def counter(session: aiohttp.ClientSession, proxy: Proxy, family: str, **labels: str) -> float:
    async with session.get(f"{proxy.admin_url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def get_all(session: aiohttp.ClientSession, url: str, n: int) -> list[tuple[int, str, str | None]]:
    """``n`` GETs at once: (status, Content-Type, RateLimit) of each."""

    async def one() -> tuple[int, str, str | None]:
        async with session.get(url) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Content-Type", ""), resp.headers.get("RateLimit")

    return await asyncio.gather(*(one() for _ in range(n)))


WHAT = {"refused": (502, "connect", "could not connect"), "closed": (502, "protocol", "failed"),
        "silent": (504, "timeout", "timed out waiting for a response")}


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "aiohttp"])
@pytest.mark.parametrize("kind", ["refused", "closed", "silent"])
async def test_each_failing_request_is_answered_and_counted_and_logged_once_per_period(
    kind: str, fast_path: bool, failing: Callable[[str], Awaitable[str]], redis_url: str, redis_client: redis.Redis,
    start_proxy: StartProxy, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    status, metric_kind, held = WHAT[kind]
    up = await failing(kind)
    # Only a silent upstream needs the short timeout; the others fail at once, and a 0.3 s
    # timeout made them 504s on a machine loaded by other work (CI, load average 9).
    proxy = await start_proxy(config([up], redis_url, fast_path, 0.3 if kind == "silent" else 10.0))
    now = frozen_clock(proxy)
    caplog.set_level(logging.INFO, logger="geolimit")
    n = 60
    answers = await get_all(session, proxy.url + "/api/items", n)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert all(s == status and ctype == "application/problem+json" and rl for s, ctype, rl in answers), answers
    assert len(lines(caplog, up)) == 1, lines(caplog, up)  # was one per request
    assert await counter(session, proxy, "geolimit_proxy_upstream_errors_total", upstream=up, kind=metric_kind) == n
    assert await counter(session, proxy, "geolimit_proxy_responses_total", code=str(status)) == n

    now[0] += 10  # the next period: its first failure writes the count of those held back, itself included
    await get_all(session, proxy.url + "/api/items", 1)
    assert len(lines(caplog, up)) == 2, lines(caplog, up)
    assert re.fullmatch(rf"upstream {up}: {n} more request\(s\) {held} in the last 10 s \(latest: .+\)",
                        lines(caplog, up)[1])
    await get_all(session, proxy.url + "/api/items", 3)  # within that period: held back
    assert len(lines(caplog, up)) == 2
    assert await counter(session, proxy, "geolimit_proxy_upstream_errors_total", upstream=up, kind=metric_kind) == n + 4

    now[0] += 2
    await proxy.stop()  # what is still held back is written as it stops
    assert lines(caplog, up)[2:] == [lines(caplog, up)[2]]
    assert re.fullmatch(rf"upstream {up}: 3 more request\(s\) {held} in the last 2 s \(latest: .+\)",
                        lines(caplog, up)[2])


async def get_broken(session: aiohttp.ClientSession, url: str, n: int) -> None:
    """``n`` GETs at once of a body the upstream breaks off: each a 200 whose body ends in an error."""

    async def one() -> None:
        async with session.get(url) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()

    await asyncio.gather(*(one() for _ in range(n)))


def accounted(messages: list[str], first: str, count: str) -> int:
    """Failures the log accounts for: its ``first`` lines and the sums of its ``count`` lines."""
    return (sum(1 for m in messages if re.fullmatch(first, m))
            + sum(int(found.group(1)) for m in messages if (found := re.fullmatch(count, m))))


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "aiohttp"])
async def test_each_upstream_and_kind_has_its_own_line_and_the_count_comes_when_failures_stop(
    fast_path: bool, upstream: Upstream, redis_url: str, redis_client: redis.Redis, start_proxy: StartProxy,
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="geolimit")
    down_a, down_b = dead_url(), dead_url()
    both = await start_proxy(config([down_a, down_b], redis_url, fast_path))  # a GET tries one, then the other
    assert {s for s, _, _ in await get_all(session, both.url + "/x", 20)} == {502}
    assert len(lines(caplog, down_a)) == len(lines(caplog, down_b)) == 1

    # One upstream, two kinds: no answer (/hang: 504) and a body that breaks off (/broken: the client's
    # connection aborted). The period is shortened: the count lines come by themselves, with no further failure.
    proxy = await start_proxy(config([upstream.url], redis_url, fast_path))
    assert proxy.forwarder is not None
    proxy.forwarder.failures.lines.every = 0.3
    assert {s for s, _, _ in await get_all(session, proxy.url + "/hang", 10)} == {504}
    await get_broken(session, proxy.url + "/broken", 10)
    prefix = f"upstream {upstream.url}: "
    hang = (re.escape(prefix) + r"no response within 0\.3s to GET /hang",
            re.escape(prefix) + r"(\d+) more request\(s\) timed out waiting for a response in the last \d+ s "
            r"\(latest: no response within 0\.3s to GET /hang\)")
    broken = (re.escape(prefix) + r"response body of GET /broken broke off \(.+\); aborting the client's connection",
              re.escape(prefix) + r"(\d+) more response\(s\) broke off mid-body in the last \d+ s "
              r"\(latest: response body of GET /broken broke off .+\)")
    await eventually(lambda: accounted(lines(caplog, upstream.url), *hang) == 10
                     and accounted(lines(caplog, upstream.url), *broken) == 10, timeout=10,
                     what="every failure accounted for in the log, the held-back ones by the timer",
                     explain=lambda: "\n".join(lines(caplog, upstream.url)))
    assert len(lines(caplog, upstream.url)) <= 8, "two kinds, a few periods of 0.3 s"
    assert await counter(session, proxy, "geolimit_proxy_upstream_errors_total", kind="timeout") == 10
    assert await counter(session, proxy, "geolimit_proxy_upstream_errors_total", kind="body_aborted") == 10


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "aiohttp"])
async def test_an_upstream_resetting_each_connection_gets_a_502_for_each_request_and_no_traceback(
    fast_path: bool, failing: Callable[[str], Awaitable[str]], redis_url: str, redis_client: redis.Redis,
    start_proxy: StartProxy, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    """The reset comes during the connect (a connect failure), after it (the request fails) or, now and
    then, between the proxy's connect and its write: on uvloop the fast path's write raised there,
    and the request ended in ``proxy: request failed`` with a traceback and its connection closed."""
    up = await failing("resetting")
    proxy = await start_proxy(config([up], redis_url, fast_path))
    caplog.set_level(logging.INFO, logger="geolimit")
    n = 200
    answers = await get_all(session, proxy.url + "/api/items", n)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert [s for s, _, _ in answers] == [502] * n
    assert 1 <= len(lines(caplog, up)) <= 2, "connect and protocol: a line each"
    failures = [await counter(session, proxy, "geolimit_proxy_upstream_errors_total", upstream=up, kind=kind)
                for kind in ("connect", "protocol")]
    assert sum(failures) == n, failures

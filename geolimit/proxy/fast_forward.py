"""One request on the fast path: decide, send it upstream, relay the answer (geolimit/proxy/fast_server.py).

The same steps, answers, metrics and log lines as the aiohttp handler
(geolimit/proxy/handler.py; its upstream failures go through the same
:class:`~geolimit.proxy.failures.UpstreamFailures`): :func:`~geolimit.proxy.decide.decide` first; then the
upstreams in turn (the next one after a connect failure, for idempotent requests,
as ``retry_connect`` says); a pooled connection that turns out to be closed by the
upstream before it answered is retried once on a new connection (idempotent
methods only, as aiohttp's client does). Response bodies of at most
:data:`~geolimit.proxy.handler.SMALL_BODY` bytes with a known length are read
whole and sent with the head in one write; others stream with flow control.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

from aiohttp.http import SERVER_SOFTWARE

from geolimit.http.keys import RequestInfo
from geolimit.proxy.decide import Local, decide, local_problem
from geolimit.proxy.fast_upstream import UpstreamConnection, UpstreamPool
from geolimit.proxy.fast_wire import FastRequest, UpstreamHead, _WireError, http_date, status_phrase
from geolimit.proxy.forwarding import DROPPED, HOP_BY_HOP, rebuilt_headers
from geolimit.proxy.handler import _IDEMPOTENT, SMALL_BODY, Forwarder
from geolimit.proxy.state import State, Upstream

if TYPE_CHECKING:
    from geolimit.proxy.fast_server import FastProtocol

__all__ = ["FastForwarder"]

_BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})  # no Content-Length: 0 added (as aiohttp)


class _Collector:
    """Collects a small body; ``done`` resolves with it."""

    __slots__ = ("done", "parts")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.parts: list[bytes] = []
        self.done: asyncio.Future[bytes] = loop.create_future()

    def body_data(self, data: bytes) -> None:
        self.parts.append(data)

    def body_done(self, exc: BaseException | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(b"".join(self.parts))
            else:
                self.done.set_exception(exc)


class _Relay:
    """Streams a body to the client as it arrives (chunked unless its length is known)."""

    __slots__ = ("chunked", "client", "done", "upstream")

    def __init__(self, client: FastProtocol, upstream: UpstreamConnection, chunked: bool) -> None:
        self.client = client
        self.upstream = upstream
        self.chunked = chunked
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def body_data(self, data: bytes) -> None:
        transport = self.client.transport
        if transport is None or transport.is_closing():
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def body_done(self, exc: BaseException | None) -> None:
        transport = self.client.transport
        if exc is None and self.chunked and transport is not None and not transport.is_closing():
            transport.write(b"0\r\n\r\n")
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    def pause(self) -> None:
        self.upstream.pause()

    def resume(self) -> None:
        self.upstream.resume()


def _client_head(head: UpstreamHead, extra: list[tuple[str, str]], empty: bool, close: bool, server: str) -> bytes:
    """The response head for the client: as :func:`~geolimit.proxy.forwarding.response_headers` and aiohttp's
    ``StreamResponse`` make it (end-to-end headers, ``extra`` replacing same-named ones, the framing, and
    ``Content-Type``, ``Date`` and ``Server`` when the upstream sent none)."""
    key = (empty, server, *[name for name, _ in extra])
    parts = head.memo.get(key)
    if parts is None:
        if len(head.memo) >= 16:
            head.memo.clear()
        parts = head.memo[key] = _client_parts(head, [name for name, _ in extra], empty, server)
    prefix, middle, has_date, suffix = parts
    lines = [prefix, *[f"{name}: {value}\r\n" for name, value in extra], middle]
    if not has_date:
        lines.append(f"Date: {http_date()}\r\n")
    lines.append(suffix)
    if close:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def _client_parts(head: UpstreamHead, extra: list[str], empty: bool, server: str) -> tuple[str, str, bool, str]:
    """What :func:`_client_head` takes from ``head`` alone: the lines before ``extra``'s, those after them
    until ``Date``, whether the upstream sent a ``Date``, and the ``Server`` line (or "")."""
    status, length, named = head.status, head.length, head.named
    replaced = {name.lower() for name in extra}
    drop_length = status in (204, 304) or not empty  # a HEAD answer keeps the upstream's length
    has_date = has_server = has_type = False
    lines = [f"HTTP/1.1 {status} {head.reason or status_phrase(status)}\r\n"]
    for name, lower, value in head.items:
        if lower in HOP_BY_HOP or lower.startswith("proxy-") or lower in named or lower in replaced or (
                drop_length and lower == "content-length"):
            continue
        if lower == "date":
            has_date = True
        elif lower == "server":
            has_server = True
        elif lower == "content-type":
            has_type = True
        lines.append(f"{name}: {value}\r\n")
    middle = []
    if not empty:
        middle.append("Transfer-Encoding: chunked\r\n" if length is None else f"Content-Length: {length}\r\n")
        if length != 0 and not has_type:
            middle.append("Content-Type: application/octet-stream\r\n")
    return "".join(lines), "".join(middle), has_date, "" if has_server else f"Server: {server}\r\n"


def _upstream_head(req: FastRequest, peer: str | None, state: State) -> tuple[str, str | None, str]:
    """The request head for the upstream around its Host line: as
    :func:`~geolimit.proxy.forwarding.request_headers` makes it (hop-by-hop and rebuilt headers dropped,
    ``Content-Length`` when known, else 0 for methods that may carry a body, as aiohttp's client sends).
    Kept in ``req.memo`` for the same peer and trusted networks (``req`` is shared by the requests with
    the same head bytes)."""
    trusted = state.trusted
    memo = req.memo.get(peer)
    if memo is not None and memo[0] is trusted:
        return memo[1], memo[2], memo[3]
    named = req.named
    lines = [f"{req.method} {req.target} HTTP/1.1\r\n"]
    for name, lower, value in req.items:
        if lower in DROPPED or lower.startswith("proxy-") or lower in named:
            continue
        lines.append(f"{name}: {value}\r\n")
    client_host = req.headers.get("host")
    tail = []
    if req.content_length is not None:
        tail.append(f"Content-Length: {req.content_length}\r\n")
    elif req.method not in _BODILESS_METHODS:
        tail.append("Content-Length: 0\r\n")
    tail += [f"{name}: {value}\r\n" for name, value in
             rebuilt_headers(client_host, req.values, peer=peer, scheme="http", trusted=trusted)]
    tail.append("\r\n")
    prefix, suffix = "".join(lines), "".join(tail)
    if len(req.memo) >= 16:
        req.memo.clear()
    req.memo[peer] = (trusted, prefix, client_host, suffix)
    return prefix, client_host, suffix


class FastForwarder:
    """Serves the requests of the fast path; shares state and round robin with the aiohttp :class:`Forwarder`."""

    def __init__(self, forwarder: Forwarder, pool: UpstreamPool, server_software: str = SERVER_SOFTWARE) -> None:
        self.server_software = server_software
        self.forwarder = forwarder
        self.metrics = forwarder.metrics
        self.pool = pool

    async def serve(self, client: FastProtocol, req: FastRequest, body: bytes) -> None:
        """Answer one request (cancelled when the client goes away: nothing counted, as aiohttp)."""
        metrics = self.metrics
        state = self.forwarder.state
        metrics.in_flight += 1
        try:
            peer = client.peer
            info = cast(RequestInfo | None, req.infos.get(peer))
            if info is None:
                if len(req.infos) >= 16:
                    req.infos.clear()
                info = req.infos[peer] = RequestInfo(req.method, req.path, req.headers, peer, req.content_length)
            route, local, extra = await decide(state, metrics, info)
            if local is not None:
                status = client.send_local(local, req)
            else:
                status = await self._forward(state, client, req, body, extra)
        finally:
            metrics.in_flight -= 1
        metrics.response(route, status)

    async def _forward(self, state: State, client: FastProtocol, req: FastRequest, body: bytes,
                       extra: list[tuple[str, str]]) -> int:
        config = state.config
        prefix, client_host, suffix = _upstream_head(req, client.peer, state)
        preserve = config.preserve_host and client_host
        candidates = self.forwarder.candidates(state, req.method, body)
        idempotent = req.method in _IDEMPOTENT
        for attempt, up in enumerate(candidates):
            data = (prefix + f"Host: {client_host if preserve else up.host}\r\n" + suffix).encode("latin-1") + body
            fresh = False
            while True:
                try:
                    conn = None if fresh else self.pool.idle(up)
                    if conn is None:
                        conn = await self.pool.connect(up, config.connect_timeout)
                except (asyncio.TimeoutError, OSError) as exc:
                    retrying = attempt + 1 < len(candidates)
                    self._count_unreachable(up, exc, retrying)
                    if retrying:
                        break
                    return client.send_local(self._unreachable(exc, req, extra), req)
                loop = client._loop
                started = loop.time()
                try:
                    head = await conn.exchange(data, req.method, config.timeout)
                except asyncio.CancelledError:
                    conn.abort()
                    raise
                except (asyncio.TimeoutError, _WireError, OSError) as exc:
                    stale = (conn.reused and not conn.received and idempotent
                             and not isinstance(exc, (asyncio.TimeoutError, _WireError)))
                    if stale and not fresh:
                        fresh = True
                        continue
                    return client.send_local(self._failed(up, exc, req, config.timeout, extra), req)
                self.metrics.upstream_latency(up.base, loop.time() - started)
                return await self._relay(client, conn, head, req, extra, up, config.timeout)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _relay(self, client: FastProtocol, conn: UpstreamConnection, head: UpstreamHead, req: FastRequest,
                     extra: list[tuple[str, str]], up: Upstream, timeout: float) -> int:
        status = head.status
        empty = req.method == "HEAD" or status in (204, 304)
        length = head.length
        close = client.closing(req)
        first = _client_head(head, extra, empty, close, self.server_software)
        if empty or length == 0 or (length is not None and length <= SMALL_BODY):
            body = conn.take_body()  # usually there with the head
            if body is None:
                collector = _Collector(asyncio.get_running_loop())
                conn.consume(collector)
                try:
                    body = await collector.done
                except asyncio.CancelledError:
                    conn.abort()
                    raise
                except (asyncio.TimeoutError, _WireError, OSError) as exc:
                    return client.send_local(self._failed(up, exc, req, timeout, extra), req)
            client.write(first + (b"" if empty else body), close)
            return status
        client.write(first, False)
        relay = _Relay(client, conn, length is None)
        client.relay = relay
        conn.consume(relay)
        try:
            await relay.done
        except asyncio.CancelledError:
            conn.abort()
            raise
        except (asyncio.TimeoutError, _WireError, OSError) as exc:
            self.forwarder.failures.body_aborted(up.base, req.method, req.path, exc)
            client.abort()
            return status
        finally:
            client.relay = None
        client.write(b"", close)
        return status

    def _count_unreachable(self, up: Upstream, exc: BaseException, retrying: bool) -> None:
        self.forwarder.failures.unreachable(up.base, exc, isinstance(exc, asyncio.TimeoutError), retrying)

    @staticmethod
    def _unreachable(exc: BaseException, req: FastRequest, extra: list[tuple[str, str]]) -> Local:
        """504 or 502, with ``extra``: the admitted request's rate limit fields (it consumed quota)."""
        if isinstance(exc, asyncio.TimeoutError):
            return local_problem(504, "Gateway Timeout", "connecting to the upstream timed out", req.path, extra)
        return local_problem(502, "Bad Gateway", "the upstream is unreachable", req.path, extra)

    def _failed(self, up: Upstream, exc: BaseException, req: FastRequest, timeout: float,
                extra: list[tuple[str, str]]) -> Local:
        """The exchange failed before the response could be sent (``extra``: as for :meth:`_unreachable`)."""
        if isinstance(exc, asyncio.TimeoutError):
            self.forwarder.failures.no_response(up.base, timeout, req.method, req.path)
            return local_problem(504, "Gateway Timeout", "the upstream did not answer in time", req.path, extra)
        self.forwarder.failures.broken(up.base, req.method, req.path, exc)
        return local_problem(502, "Bad Gateway", "the upstream failed to answer", req.path, extra)

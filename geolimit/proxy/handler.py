"""The request path: decide, then stream the request to an upstream and the response back.

Bodies are streamed both ways (at most one read buffer per direction in memory);
only bodies whose ``Content-Length`` is at most :data:`SMALL_BODY` bytes are read
whole, which saves a few event-loop round trips per request. Errors are RFC 9457
``application/problem+json``: 400 (unreadable cost), 408 (the body did not arrive
within ``body_timeout``), 413 (over ``max_body``), 429 (rate limited), 502 (upstream unreachable or broken), 503 (a fail-closed
limit could not be decided), 504 (upstream timeout). An upstream failure after
the response has started aborts the client's connection, so a truncated
response never looks complete.

Body deadline: the time the proxy spends waiting for the client's body (not for the
upstream to take it) may be ``body_timeout`` seconds (30 s: the fast path's for a
head and its small body), plus one second for every :data:`BODY_RATE` bytes received,
so an upload that moves keeps going, however slow its uplink, and a trickle does not:
past it, the upstream exchange is abandoned (its connection closed) and the client gets
408, connection closed.

Retries: a request goes to the next upstream (round robin) only when connecting
failed, its method is idempotent and its body is not being streamed (no body,
or a small one already read); each upstream is tried at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

import aiohttp
from aiohttp import StreamReader, web
from multidict import CIMultiDict
from yarl import URL

from geolimit.http.keys import RequestInfo
from geolimit.proxy.config import ProxyConfig
from geolimit.proxy.decide import Local, decide, local_problem
from geolimit.proxy.failures import UpstreamFailures
from geolimit.proxy.forwarding import request_headers, response_headers
from geolimit.proxy.metrics import ProxyMetrics
from geolimit.proxy.state import State, Upstream, upstream_for

__all__ = ["BODY_RATE", "SMALL_BODY", "Forwarder", "State", "Upstream", "problem", "upstream_for"]

log = logging.getLogger("geolimit.proxy")

SMALL_BODY = 64 * 1024
#: Bytes of a request body that buy one more second of ``body_timeout``: an upload must
#: average 1 KiB/s (8 kbit/s, below any real uplink; Apache's mod_reqtimeout asks 500 B/s)
#: once its first ``body_timeout`` is spent. It was 64 KiB: uploads under 512 kbit/s were cut.
BODY_RATE = 1024
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
_NO_BODY_STATUS = frozenset({204, 304})


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The client went away while the proxy read its body."""


class _BodyTimeout(asyncio.TimeoutError):
    """The request body did not arrive in time (raised by the body's reads once its deadline passed).

    A TimeoutError: aiohttp's server, which reads what is left of a body after the answer
    (lingering), stops there and closes, where another exception is logged as unhandled."""


class _BodyDeadline:
    """``seconds`` of waiting for the client's body, plus one per :data:`BODY_RATE` bytes received;
    then the body's reads raise :class:`_BodyTimeout`. Only the time spent waiting for the client
    counts (:meth:`waiting` to :meth:`got`), not the time the upstream takes to accept what came."""

    def __init__(self, content: StreamReader, seconds: float) -> None:
        self._content = content
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._waited = 0.0
        self._since: float | None = None
        self.expired = False
        self._timer = self._loop.call_later(seconds, self._check)

    def waiting(self) -> None:
        self._since = self._loop.time()

    def got(self) -> None:
        if self._since is not None:
            self._waited += self._loop.time() - self._since
            self._since = None

    def _check(self) -> None:
        now = self._loop.time()
        waited = self._waited + (now - self._since if self._since is not None else 0.0)
        left = self.seconds + self._content.total_bytes / BODY_RATE - waited
        if self._content.is_eof():
            return  # all of it arrived
        if left > 0:
            self._timer = self._loop.call_later(left, self._check)
            return
        self.expired = True
        self._content.set_exception(_BodyTimeout())

    def cancel(self) -> None:
        self._timer.cancel()


def _origin_form(raw_target: str) -> str | None:
    """The request target as ``/path?query`` (absolute-form reduced), or None if it is neither."""
    if raw_target.startswith("/"):
        return raw_target
    if raw_target.startswith(("http://", "https://")):
        return URL(raw_target).raw_path_qs
    return None


def problem(status: int, title: str, detail: str, instance: str, headers: Iterable[tuple[str, str]] = ()) -> web.Response:
    """An RFC 9457 response; ``instance`` is the request path (percent-encoded here)."""
    return _response(local_problem(status, title, detail, instance, headers))


def _response(local: Local) -> web.Response:
    resp = web.Response(status=local.status, body=local.body, headers=CIMultiDict(local.headers))
    resp.content_type = local.content_type
    return resp


class Forwarder:
    """Handles every request of the proxy listener (an aiohttp low-level server handler)."""

    def __init__(self, state: State, session: aiohttp.ClientSession, metrics: ProxyMetrics) -> None:
        self.state = state
        self.session = session
        self.metrics = metrics
        self.failures = UpstreamFailures(metrics)  # the fast path's too
        self._next = 0

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        metrics = self.metrics
        metrics.in_flight += 1
        try:
            route, resp = await self._handle(self.state, request)
        finally:
            metrics.in_flight -= 1
        metrics.response(route, resp.status)
        return resp

    async def _handle(self, state: State, request: web.BaseRequest) -> tuple[str, web.StreamResponse]:
        info = RequestInfo(request.method, request.path, request.headers, request.remote, request.content_length)
        route, local, extra = await decide(state, self.metrics, info)
        if local is not None:
            return route, self._unread(request, _response(local))
        return route, await self._forward(state, request, extra)

    @staticmethod
    def _unread(request: web.BaseRequest, resp: web.StreamResponse) -> web.StreamResponse:
        """A response sent before the request's body was read: close the connection after it."""
        if request.body_exists and not request.content.is_eof():
            resp.force_close()
        return resp

    async def _body(self, request: web.BaseRequest, limit: int | None, failure: list[str],
                    deadline: _BodyDeadline) -> AsyncIterator[bytes]:
        total = 0
        content = request.content
        while True:
            deadline.waiting()
            try:
                chunk = await content.readany()
            except _BodyTimeout:
                failure.append("body_timeout")
                raise
            except Exception:
                failure.append("client")
                raise
            finally:
                deadline.got()
            if not chunk:
                return
            total += len(chunk)
            if limit is not None and total > limit:
                failure.append("too_large")
                raise _BodyTooLarge
            yield chunk

    async def _forward(
        self, state: State, request: web.BaseRequest, extra: Iterable[tuple[str, str]]
    ) -> web.StreamResponse:
        """Send the request upstream (the next in turn; others if connecting fails) and relay the answer."""
        target = _origin_form(request.raw_path)
        if target is None:
            return problem(400, "Bad Request", "the request target must be a path", "/", extra)
        if not request.body_exists:
            return await self._exchange(state, request, extra, target, None)
        deadline = _BodyDeadline(request.content, state.config.body_timeout)
        try:
            return await self._exchange(state, request, extra, target, deadline)
        finally:
            deadline.cancel()

    async def _exchange(self, state: State, request: web.BaseRequest, extra: Iterable[tuple[str, str]],
                        target: str, deadline: _BodyDeadline | None) -> web.StreamResponse:
        failure: list[str] = []
        try:
            data = await self._request_body(request, state.config.max_body, failure, deadline)
        except _ClientGone:
            return self._client_gone(request, "while sending its body")
        except _BodyTimeout:
            return self._body_late(request, state.config, extra)
        headers = request_headers(
            request.headers, peer=request.remote, scheme=request.scheme, trusted=state.trusted,
            upstream_host=None, content_length=request.content_length,
        )
        candidates = self.candidates(state, request.method, data)
        for attempt, up in enumerate(candidates):
            try:
                upstream = await self._send(state, request.method, up, target, headers, data)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                retrying = attempt + 1 < len(candidates)
                self._count_unreachable(up, exc, retrying)
                if retrying:
                    continue
                return self._unreachable(request, exc, extra)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return self._failed(request, up, exc, failure, state.config, extra)
            try:
                return await self._relay(request, upstream, extra, up, state.config)
            finally:
                upstream.release()  # back to the pool if the exchange completed, else closed
        raise AssertionError("unreachable")  # pragma: no cover

    async def _request_body(self, request: web.BaseRequest, limit: int | None, failure: list[str],
                            deadline: _BodyDeadline | None) -> bytes | AsyncIterator[bytes] | None:
        """None (no body), a small body read whole, or a stream (raises _ClientGone, _BodyTimeout)."""
        if deadline is None:
            return None
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = request.content_length
        if length is None or length > SMALL_BODY:
            return self._body(request, limit, failure, deadline)
        deadline.waiting()
        try:
            return await request.read()
        except _BodyTimeout:
            raise
        except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _ClientGone from exc
        finally:
            deadline.got()

    def candidates(self, state: State, method: str,
                    data: bytes | AsyncIterator[bytes] | None) -> list[Upstream]:
        """The upstreams to try in order: the next in turn, then the others if a retry is safe."""
        upstreams = state.upstreams
        start = self._next
        self._next = (start + 1) % len(upstreams)
        streamed = data is not None and not isinstance(data, bytes)  # cannot be sent twice
        retry = state.config.retry_connect and method in _IDEMPOTENT and not streamed
        count = len(upstreams) if retry else 1
        return [upstreams[(start + i) % len(upstreams)] for i in range(count)]

    async def _send(self, state: State, method: str, up: Upstream, target: str, headers: CIMultiDict[str],
                    data: bytes | AsyncIterator[bytes] | None) -> aiohttp.ClientResponse:
        """One exchange with ``up``, until the response headers arrived."""
        if not state.config.preserve_host or "Host" not in headers:
            headers["Host"] = up.host
        loop = asyncio.get_running_loop()
        started = loop.time()
        upstream = await self.session.request(
            method, URL(up.base + target, encoded=True), headers=headers, data=data,
            allow_redirects=False, timeout=state.timeout,
        )
        self.metrics.upstream_latency(up.base, loop.time() - started)
        return upstream

    def _count_unreachable(self, up: Upstream, exc: Exception, retrying: bool) -> None:
        self.failures.unreachable(up.base, exc, isinstance(exc, aiohttp.ConnectionTimeoutError), retrying)

    def _unreachable(self, request: web.BaseRequest, exc: Exception,
                     extra: Iterable[tuple[str, str]]) -> web.StreamResponse:
        """The answer when no upstream could be connected to: 504 on a timeout, else 502 (with ``extra``, the
        admitted request's rate limit fields: it consumed quota all the same)."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return self._unread(request, problem(
                504, "Gateway Timeout", "connecting to the upstream timed out", request.path, extra))
        return self._unread(request, problem(502, "Bad Gateway", "the upstream is unreachable", request.path, extra))

    def _failed(self, request: web.BaseRequest, up: Upstream, exc: BaseException, failure: list[str],
                config: ProxyConfig, extra: Iterable[tuple[str, str]]) -> web.StreamResponse:
        """The exchange failed before the response headers arrived (``extra``: as for :meth:`_unreachable`)."""
        if "too_large" in failure:
            return self._unread(request, problem(
                413, "Content Too Large", f"the body exceeds {config.max_body} bytes", request.path, extra))
        if "body_timeout" in failure:
            return self._body_late(request, config, extra)
        if "client" in failure:
            return self._client_gone(request, "while sending its body")
        if isinstance(exc, asyncio.TimeoutError):
            self.failures.no_response(up.base, config.timeout, request.method, request.path)
            return self._unread(request, problem(
                504, "Gateway Timeout", "the upstream did not answer in time", request.path, extra))
        self.failures.broken(up.base, request.method, request.path, exc)
        return self._unread(request, problem(502, "Bad Gateway", "the upstream failed to answer", request.path,
                                             extra))

    def _body_late(self, request: web.BaseRequest, config: ProxyConfig,
                   extra: Iterable[tuple[str, str]]) -> web.StreamResponse:
        """408: the body did not arrive in time; the connection closes after the answer."""
        log.debug("client %s: request body of %s %s not in within %gs", request.remote, request.method,
                  request.path, config.body_timeout)
        resp = problem(408, "Request Timeout", f"the request body did not arrive within {config.body_timeout:g}s",
                       request.path, extra)
        resp.force_close()
        return resp

    @staticmethod
    def _client_gone(request: web.BaseRequest, when: str) -> web.StreamResponse:
        log.debug("client %s went away %s", request.remote, when)
        resp = web.Response(status=499)  # never delivered; counted as nginx's "client closed request"
        resp.force_close()
        return resp

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse,
                     extra: Iterable[tuple[str, str]], up: Upstream, config: ProxyConfig) -> web.StreamResponse:
        status = upstream.status
        resp = web.StreamResponse(status=status, reason=upstream.reason,
                                  headers=response_headers(upstream.headers, extra))
        length = upstream.content_length
        if request.method == "HEAD" or status in _NO_BODY_STATUS or status < 200:
            await resp.prepare(request)
            return resp
        if length is not None and length <= SMALL_BODY:
            try:
                body = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return self._failed(request, up, exc, [], config, extra)
            try:
                await resp.prepare(request)
                await resp.write_eof(body)
            except ConnectionError:
                log.debug("client %s went away before the response was sent", request.remote)
            return resp
        try:
            await resp.prepare(request)
        except ConnectionError:
            return resp
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.failures.body_aborted(up.base, request.method, request.path, exc)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            if not chunk:
                break
            try:
                await resp.write(chunk)
            except ConnectionError:
                log.debug("client %s went away during the response", request.remote)
                return resp
        return resp  # aiohttp writes the end of the response (write_eof)

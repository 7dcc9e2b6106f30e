"""The request path: decide, then stream the request to an upstream and the response back.

Bodies are streamed both ways (at most one read buffer per direction in memory);
only bodies whose ``Content-Length`` is at most :data:`SMALL_BODY` bytes are read
whole, which saves a few event-loop round trips per request. Errors are RFC 9457
``application/problem+json``: 400 (unreadable cost), 413 (over ``max_body``),
429 (rate limited), 502 (upstream unreachable or broken), 503 (a fail-closed
limit could not be decided), 504 (upstream timeout). An upstream failure after
the response has started aborts the client's connection, so a truncated
response never looks complete.

Retries: a request goes to the next upstream (round robin) only when connecting
failed, its method is idempotent and its body is not being streamed (no body,
or a small one already read); each upstream is tried at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from geolimit.http.keys import RequestInfo
from geolimit.proxy.config import ProxyConfig
from geolimit.proxy.decide import Local, decide, local_problem
from geolimit.proxy.forwarding import request_headers, response_headers
from geolimit.proxy.metrics import ProxyMetrics
from geolimit.proxy.state import State, Upstream, upstream_for

__all__ = ["SMALL_BODY", "Forwarder", "State", "Upstream", "problem", "upstream_for"]

log = logging.getLogger("geolimit.proxy")

SMALL_BODY = 64 * 1024
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
_NO_BODY_STATUS = frozenset({204, 304})


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The client went away while the proxy read its body."""


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

    async def _body(self, request: web.BaseRequest, limit: int | None, failure: list[str]) -> AsyncIterator[bytes]:
        total = 0
        content = request.content
        while True:
            try:
                chunk = await content.readany()
            except Exception:
                failure.append("client")
                raise
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
        failure: list[str] = []
        try:
            data = await self._request_body(request, state.config.max_body, failure)
        except _ClientGone:
            return self._client_gone(request, "while sending its body")
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

    async def _request_body(self, request: web.BaseRequest, limit: int | None,
                            failure: list[str]) -> bytes | AsyncIterator[bytes] | None:
        """None (no body), a small body read whole, or a stream (raises _ClientGone)."""
        if not request.body_exists:
            return None
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = request.content_length
        if length is None or length > SMALL_BODY:
            return self._body(request, limit, failure)
        try:
            return await request.read()
        except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _ClientGone from exc

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
        timed_out = isinstance(exc, aiohttp.ConnectionTimeoutError)
        self.metrics.upstream_error(up.base, "timeout" if timed_out else "connect")
        log.warning("upstream %s: cannot connect: %.200s%s", up.base, exc,
                    "; trying the next upstream" if retrying else "")

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
        if "client" in failure:
            return self._client_gone(request, "while sending its body")
        if isinstance(exc, asyncio.TimeoutError):
            self.metrics.upstream_error(up.base, "timeout")
            log.warning("upstream %s: no response within %.3gs to %s %s", up.base, config.timeout,
                        request.method, request.path)
            return self._unread(request, problem(
                504, "Gateway Timeout", "the upstream did not answer in time", request.path, extra))
        self.metrics.upstream_error(up.base, "protocol")
        log.warning("upstream %s: %s %s failed: %s: %.200s", up.base, request.method, request.path,
                    type(exc).__name__, exc)
        return self._unread(request, problem(502, "Bad Gateway", "the upstream failed to answer", request.path,
                                             extra))

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
                self.metrics.upstream_error(up.base, "body_aborted")
                log.warning("upstream %s: response body of %s %s broke off (%s: %.200s); aborting the client's "
                            "connection", up.base, request.method, request.path, type(exc).__name__, exc)
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

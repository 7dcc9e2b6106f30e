"""The proxy's fast path: the listener served by asyncio Protocols, no aiohttp in the data path.

Why: aiohttp's server and client cost more CPU per request than the 60 % goal of
the proxy benchmark leaves (docs/design.md §9). :class:`FastProtocol` parses the
common requests itself (:func:`~geolimit.proxy.fast_wire.request_head`:
HTTP/1.1, origin-form, no body or a ``Content-Length`` body of at most
:data:`~geolimit.proxy.handler.SMALL_BODY` bytes within ``max_body``) and serves
them with :class:`~geolimit.proxy.fast_forward.FastForwarder` over pooled upstream
connections. Any other request (chunked or large uploads, ``Expect``, ``Upgrade``,
HTTP/1.0, absolute-form targets, bytes outside printable ASCII, heads over
:data:`MAX_HEAD`, anything malformed) hands the connection, at that request's first
byte, to aiohttp's server running the usual handler, which serves or refuses it as
the proxy always has; the connection stays with aiohttp from then on.

Connections count against the listener's cap (``max_connections``: the
:class:`~geolimit.http.connections.ListenerGuard`'s, shared with the connections handed
to aiohttp): one over it is closed at its accept.

Timeouts of the client side: a request head (and its small body) must arrive within
:data:`HEAD_TIMEOUT` seconds of its first byte, plus one second per
:data:`~geolimit.proxy.handler.BODY_RATE` bytes of the body received (else 408 and the
connection is closed: a slow sender cannot hold a connection forever), and a new connection's first
byte within :data:`HEAD_TIMEOUT` of its accept (else it is closed); an idle keep-alive
connection is closed after :data:`KEEPALIVE_TIMEOUT` seconds (75, as the aiohttp listeners).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import cast

from geolimit.http.connections import ListenerGuard
from geolimit.http.listener import KEEPALIVE_TIMEOUT  # the same as the aiohttp listeners'
from geolimit.proxy.decide import Local, local_problem
from geolimit.proxy.fast_forward import FastForwarder, _Relay
from geolimit.proxy.fast_upstream import LazyDeadline
from geolimit.proxy.fast_wire import (
    FastRequest,
    http_date,
    plausible_start,
    request_head,
    serialize_head,
    status_phrase,
)
from geolimit.proxy.handler import BODY_RATE

__all__ = ["HEAD_TIMEOUT", "KEEPALIVE_TIMEOUT", "MAX_HEAD", "FastProtocol", "FastServer"]

log = logging.getLogger("geolimit.proxy")

MAX_HEAD = 16 * 1024  # a longer head goes to aiohttp (which allows 8190 bytes a line)
HEAD_TIMEOUT = 30.0
_MAX_BUFFER = 256 * 1024  # pipelined bytes held while a request is served (then reading pauses)


class FastProtocol(LazyDeadline, asyncio.Protocol):
    """One client connection on the fast path."""

    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.relay: _Relay | None = None
        self._buf = b""
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # 0: none (a request is being served)
        self._head_timer = False  # the deadline is a partial request's, not an idle connection's
        self._partial_since = 0.0  # when the partial request's first byte came (its deadline's start)
        self._paused = False
        self._close_after = False
        self._counted = False  # holds a place under the listener's cap
        self._loop = server.loop

    # -- asyncio callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.server.guard
        if guard is not None and not guard.admit():  # over the listener's max_connections
            transport.close()
            return
        self._counted = guard is not None
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = self.transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, (list, tuple)) else None
        self.server.connections.add(self)
        self._fresh()

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if self._task is None:
            self._next()
        elif len(self._buf) > _MAX_BUFFER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return False  # close: a request in flight is cancelled, as aiohttp's handler_cancellation does

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self.server.connections.discard(self)
        self._drop_timer()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        self.transport = None

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.pause()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.resume()

    # -- requests -------------------------------------------------------------------------------

    def _next(self) -> None:
        buf = self._buf
        if not buf:
            self._idle()
            return
        end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
        if end < 0:
            if len(buf) > MAX_HEAD or not plausible_start(buf):
                self._hand_off()  # aiohttp refuses it at once or serves it
            else:
                self._partial()
            return
        req = request_head(buf[:end + 4])
        if req is None:
            self._hand_off()
            return
        length = req.content_length or 0
        if length and length > self.server.body_limit():
            self._hand_off()
            return
        need = end + 4 + length
        if len(buf) < need:
            self._partial()
            # The body's bytes buy time, as on aiohttp's path ([proxy] body_timeout's credit):
            # one second per BODY_RATE bytes received, so a slow but steady upload of a small
            # body is not cut off while a trickle still is.
            credit = (len(buf) - end - 4) // BODY_RATE
            if credit:
                self._deadline = max(self._deadline, self._partial_since + HEAD_TIMEOUT + credit)
            return
        body = buf[end + 4:need]
        self._buf = buf[need:]
        self._cancel_timer()
        self._close_after = req.close
        self.server.served += 1
        self._task = self._loop.create_task(self.server.forwarder.serve(self, req, body))
        self._task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        if task is not self._task:
            return  # cancelled with its connection
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("proxy: request failed", exc_info=task.exception())
            self.abort()
            return
        if self.transport is None or self.transport.is_closing():
            return
        if self._close_after or self.server.closing:
            self.transport.close()
            return
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        self._next()

    def closing(self, req: FastRequest) -> bool:
        """Whether the connection closes after this request's response."""
        self._close_after = self._close_after or req.close or self.server.closing
        return self._close_after

    def write(self, data: bytes, close: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if data:
                self.transport.write(data)
            if close:
                self._close_after = True

    def send_local(self, local: Local, req: FastRequest) -> int:
        """Answer with a response the proxy made; its status."""
        headers = [*local.headers, ("Content-Type", local.content_type),
                   ("Content-Length", str(len(local.body))), ("Date", http_date()),
                   ("Server", self.server.server_software)]
        if self.closing(req):
            headers.append(("Connection", "close"))
        reason = status_phrase(local.status)
        self.write(serialize_head(f"HTTP/1.1 {local.status} {reason}", headers) + local.body, False)
        return local.status

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- timers and hand-off ------------------------------------------------------------------------

    def _fresh(self) -> None:
        # A new connection's first request must start within HEAD_TIMEOUT of its accept, as on
        # the agent's listeners: one that sends nothing is closed then, without an answer.
        self._head_timer = False
        self._arm(HEAD_TIMEOUT)

    def _idle(self) -> None:
        self._head_timer = False
        self._arm(KEEPALIVE_TIMEOUT)

    def _partial(self) -> None:
        if not self._head_timer:
            self._head_timer = True
            self._partial_since = self._loop.time()
            self._arm(HEAD_TIMEOUT)

    def _timed_out(self) -> None:
        self._timer = None
        if not self._deadline or self.transport is None or self._task is not None:
            return
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._timed_out)
            return
        if self._head_timer:
            local = local_problem(408, "Request Timeout", f"the request did not arrive within {HEAD_TIMEOUT:g}s",
                                  "/")
            headers = [("Content-Type", local.content_type), ("Content-Length", str(len(local.body))),
                       ("Connection", "close")]
            self.transport.write(serialize_head("HTTP/1.1 408 Request Timeout", headers) + local.body)
        self.transport.close()

    def _cancel_timer(self) -> None:
        self._deadline = 0.0
        self._head_timer = False

    def _drop_timer(self) -> None:
        self._cancel_timer()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        if self._counted and self.server.guard is not None:
            self._counted = False
            self.server.guard.release()

    def _hand_off(self) -> None:
        """Give the connection to aiohttp's server, from this request's first byte on."""
        transport = self.transport
        if transport is None:
            return
        self._drop_timer()
        self.server.connections.discard(self)
        self.server.handed_off += 1
        self._release()  # the place goes with the connection: aiohttp's guard takes it back at once
        self.transport = None
        handler = self.server.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused:
            transport.resume_reading()
        data, self._buf = self._buf, b""
        if data:
            handler.data_received(data)


class FastServer:
    """The fast path's listening sockets and connections."""

    def __init__(self, forwarder: FastForwarder, fallback: Callable[[], asyncio.Protocol],
                 body_limit: Callable[[], int], server_software: str, guard: ListenerGuard | None = None) -> None:
        """``fallback()``: aiohttp's protocol for a connection handed off; ``guard``: the listener's
        cap on open connections (the fast path's and those handed to aiohttp, under ``guard``'s too)."""
        self.forwarder = forwarder
        self.fallback = fallback
        self.guard = guard
        self.body_limit = body_limit
        self.server_software = server_software
        self.loop = asyncio.get_running_loop()
        self.connections: set[FastProtocol] = set()
        self.closing = False
        self.served = 0  # requests parsed here
        self.handed_off = 0  # connections given to aiohttp
        self._servers: list[asyncio.AbstractServer] = []

    async def serve(self, sockets: list[socket.socket], backlog: int = 1024) -> None:
        for sock in sockets:
            self._servers.append(await self.loop.create_server(lambda: FastProtocol(self), sock=sock,
                                                               backlog=backlog))

    async def stop(self, timeout: float) -> None:
        """Stop accepting; requests in flight get ``timeout`` seconds, then their connections are cut."""
        self.closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if conn._task is None and conn.transport is not None:
                conn.transport.close()
        tasks = [conn._task for conn in self.connections if conn._task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
        for conn in list(self.connections):
            conn.abort()
        self._servers.clear()
        self.forwarder.pool.close()

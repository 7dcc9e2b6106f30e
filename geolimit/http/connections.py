"""A deadline for request heads and a cap on open connections, for an aiohttp listener.

aiohttp's server has no deadline for a request's head (the request line and the
headers): a connection that sends half a request line is held until its
``keepalive_timeout`` (3630 s in aiohttp 3.14), and 20,000 of them used up an agent's
file descriptors, so neither clients nor peers could connect. A listener served
through a :class:`ListenerGuard` (``geolimit.http.listener.listen`` does it) has:

* A **head deadline**: a connection must deliver a complete request head within
  ``head_timeout`` seconds of its accept (the first request; after a TLS handshake,
  itself bounded by the same time) and of the first byte of each later request; else
  it gets ``408`` (when part of a head came) and is closed. The time a keep-alive
  connection idles *between* requests stays aiohttp's ``keepalive_timeout``; a request
  being handled (its body included: the routes read bodies within their own
  deadlines) has no head deadline.
* A **connection cap**: at most ``max_connections`` open connections on the listener
  (by default a share of ``RLIMIT_NOFILE`` that leaves file descriptors for Redis,
  peers and files: :func:`default_max_connections`); one more is closed as soon as it
  is accepted, before aiohttp sees it. On a TLS listener a connection counts from its
  accept, its handshake included (asyncio's ``ssl=`` server hands a connection over
  only once its handshake is done: connections that never finished one were not
  counted, and 2000 of them pinned an agent at its file descriptor limit).

Each closed connection is counted (``dropped(reason)``: ``connection_limit`` or
``head_timeout``) and the listener logs at most one line per reason every :data:`LOG_EVERY`
seconds (:class:`~geolimit.log_every.LogEvery`), the next one counting those held back:
never a line per connection.

How it works, with aiohttp's public API only: a :class:`~aiohttp.web.BaseSite`
(``geolimit.http.listener``) whose ``create_server`` gets a protocol factory wrapping aiohttp's
:class:`~aiohttp.web.RequestHandler` (``server()``) in :class:`_Connection`, which
sees every byte before aiohttp does; and ``server.request_handler`` wrapped to learn
when each request is dispatched (its head complete) and handled. aiohttp's parser
does not say whether it holds part of a head, so the connection tracks where the
requests dispatched so far end on the wire: the head ends at the first blank line
after the previous request (a head holds none before its end), and the body is
``Content-Length`` bytes. Bytes beyond that end, while no request is being handled,
are the next head's: its deadline runs. A chunked (or upgraded) request read to its
end ends where the bytes received by its answer do (bytes a client pipelined after it
would count as idle, held no longer than an idle connection is). When the end cannot
be known otherwise (pipelined bytes that arrived before the request ahead of them was
dispatched, a body not read to its end) every later request counts as having left
such bytes, so after each response the next head must come within ``head_timeout``: a
client idling longer is closed sooner than ``keepalive_timeout``, never held longer.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from geolimit.http import bad_requests
from geolimit.log_every import LogEvery

__all__ = ["HEAD_TIMEOUT", "LOG_EVERY", "ListenerGuard", "default_max_connections"]

log = logging.getLogger("geolimit.http")
T = TypeVar("T")

#: Seconds a request head may take (the default of the agent's ``[region] head_timeout``).
HEAD_TIMEOUT = 10.0
#: Seconds between two log lines of one listener about the connections it closed.
LOG_EVERY = 10.0
#: File descriptors left out of the listeners' share: Redis, peers, the logs, the files
#: opened by a reload (at least this many, or a tenth of the limit when that is more).
SPARE_FDS = 256
_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\n"
           b"Content-Length: %d\r\n\r\n%s")


def default_max_connections(listeners: int = 1) -> int:
    """Open connections one of ``listeners`` listeners may hold: the soft ``RLIMIT_NOFILE``
    less max(:data:`SPARE_FDS`, a tenth of it), shared out (at least 16 each)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft > 1 << 20:
            soft = 1 << 20
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        soft = 1024
    return max(16, (soft - max(SPARE_FDS, soft // 10)) // max(1, listeners))


def _ignore(reason: str) -> None:
    pass


class ListenerGuard:
    """The head deadline and connection cap of one listener (all of its sockets).

    ``head_timeout`` and ``max_connections`` are read for each connection (a reload that
    changes them applies to the next ones); ``dropped`` is called with the reason of each
    connection closed (``connection_limit``, ``head_timeout``); ``label`` names the
    listener in the log (``where``, its address, is set by ``listen``).
    """

    def __init__(self, label: str, *, head_timeout: Callable[[], float] = lambda: HEAD_TIMEOUT,
                 max_connections: Callable[[], int] | None = None,
                 dropped: Callable[[str], None] = _ignore) -> None:
        self.label = label
        self.where = ""
        self.head_timeout = head_timeout
        cap = default_max_connections()
        self.max_connections = max_connections or (lambda: cap)
        self.dropped = dropped
        self.open = 0  # connections now open (admitted)
        self.lines = LogEvery(log, LOG_EVERY)  # one line per reason every LOG_EVERY seconds, counting the rest

    def protocol_factory(self, server: web.Server, tls: ssl.SSLContext | None = None) -> Callable[[], asyncio.Protocol]:
        """What ``loop.create_server`` takes to serve ``server`` under this guard (and the proxy's
        fast path hands its connections to); ``tls``: each connection's handshake is made here,
        within ``head_timeout``. Installs the summary of malformed requests' log lines."""
        bad_requests.install()  # a malformed request is counted in one line per 10 s, not logged with a traceback
        if not isinstance(server.request_handler, _Dispatch):  # once per server
            server.request_handler = _Dispatch(server.request_handler)
        return lambda: _Connection(self, server, tls)

    def close(self) -> None:
        """Log what is held back and stop the log's timer (the listener stopped)."""
        self.lines.close()

    # -- the connections' side ----------------------------------------------------------

    def admit(self) -> bool:
        """Take a place for a new connection; False (counted, logged) when none is left: close it.
        (The proxy's fast path takes places for its own connections, and gives one back with
        :meth:`release` just before it hands that connection to aiohttp.)"""
        if self.open >= self.max_connections():
            self._note("connection_limit")
            return False
        self.open += 1
        return True

    def release(self) -> None:
        """Give back a place taken by :meth:`admit`."""
        self.open -= 1

    def _note(self, reason: str) -> None:
        self.dropped(reason)
        if reason == "connection_limit":
            detail, what = f"refused a connection over the limit of {self.max_connections()} open", "refused"
        else:
            detail = f"closed a connection that sent no complete request head within {self.head_timeout():g} s"
            what = "closed"
        self.lines.warn(reason, f"{self.label} listener {self.where}", detail, f"connection(s) {what} ({reason})")


class _Eager:
    """A coroutine run at once up to its first wait, then on each wake-up (Python 3.12's eager
    tasks, on 3.11 and uvloop); ``done(result, exception)`` gets its end."""

    __slots__ = ("_coro", "_done")

    def __init__(self, coro: Coroutine[Any, Any, T], done: Callable[[T | None, BaseException | None], None]) -> None:
        self._coro: Coroutine[Any, Any, Any] = coro
        self._done: Callable[[Any, BaseException | None], None] = done
        self._step()

    def _step(self, _: object = None) -> None:
        try:
            waiting = self._coro.send(None)
        except StopIteration as stop:
            self._done(stop.value, None)
        except Exception as exc:
            self._done(None, exc)
        else:  # a future (start_tls() waits on one only)
            waiting._asyncio_future_blocking = False
            waiting.add_done_callback(self._step)


class _Dispatch:
    """``server.request_handler``, telling each request's connection when it starts and ends."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        transport = request.transport
        conn = transport.get_protocol() if transport is not None else None
        if not isinstance(conn, _Connection):
            return await self.handler(request)
        conn.dispatched(request)
        try:
            return await self.handler(request)
        finally:
            conn.finished(request)


def _framed(request: web.BaseRequest) -> bool:
    """Whether the request ends ``Content-Length`` bytes after its head (no chunks, no upgrade)."""
    headers = request.headers
    return "Transfer-Encoding" not in headers and "Upgrade" not in headers and request.method != "CONNECT"


class _Connection(asyncio.Protocol):
    """One connection: aiohttp's handler behind the cap and the head deadline."""

    __slots__ = ("_busy", "_counted", "_deadline", "_early", "_end", "_guard", "_handshake", "_head_end", "_inner",
                 "_loop", "_mark", "_received", "_server", "_tail", "_timer", "_tls", "_transport")

    def __init__(self, guard: ListenerGuard, server: web.Server, tls: ssl.SSLContext | None = None) -> None:
        self._guard = guard
        self._server = server
        self._tls = tls
        self._counted = False  # holds one of the guard's places
        self._handshake: _Eager | None = None  # the TLS handshake in progress
        self._early = b""  # bytes decrypted before the TLS handshake's end was seen
        self._inner: web.RequestHandler | None = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time by which a head must be complete; 0: none running
        self._mark = 0  # bytes received when the deadline started
        self._received = 0  # bytes received on the connection
        self._end: int | None = 0  # where the requests dispatched so far end on the wire; None: unknown
        self._head_end: int | None = None  # where the head after _end ends, once its blank line came
        self._tail = b""  # the last bytes searched for that blank line (it may straddle two reads)
        self._busy = False  # a request is being handled

    # -- asyncio's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit():
            transport.close()  # nothing was written: the socket is closed at once
            return
        self._counted = True
        if self._tls is None:
            self._serve(transport)
            return
        # Started here, not in a task: uvloop starts reading as soon as this returns, and the bytes
        # read before start_tls() made its SSL protocol the transport's would be lost to it.
        handshake = self._loop.start_tls(transport, self, self._tls, server_side=True,
                                         ssl_handshake_timeout=self._guard.head_timeout())
        self._handshake = _Eager(handshake, self._handshaken)

    def _handshaken(self, transport: asyncio.BaseTransport | None, exc: BaseException | None) -> None:
        self._handshake = None
        if exc is not None or transport is None:  # timed out, not TLS, reset: start_tls() closed it
            log.debug("%s listener %s: TLS handshake failed: %r", self._guard.label, self._guard.where, exc)
            self._release()
        elif self._counted:  # else lost at the end of its handshake
            self._serve(transport)
            early, self._early = self._early, b""
            if early:
                self.data_received(early)

    def _serve(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self._inner = inner = self._server()
        self._arm()  # the first head: from the accept (or the end of the TLS handshake)
        inner.connection_made(transport)

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._guard.release()

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is None:
            if self._handshake is not None:  # TLS: decrypted before start_tls() returned it
                self._early += data
            return
        start = self._received
        self._received = received = start + len(data)
        end = self._end
        if end is not None and self._head_end is None and received > end:
            self._scan(data, start, end)
        if not self._busy and not self._deadline and (end is None or received > end):
            self._arm()  # a head started
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            self._inner.eof_received()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        inner, self._inner = self._inner, None
        if inner is None:
            return
        self._deadline = 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # -- requests ---------------------------------------------------------------------------

    def dispatched(self, request: web.BaseRequest) -> None:
        """aiohttp parsed a head and calls the application."""
        self._busy = True
        self._deadline = 0.0
        end, head_end = self._end, self._head_end
        self._head_end, self._tail = None, b""
        if end is None or head_end is None or not _framed(request):
            self._end = None
            return
        end = head_end + (request.content_length or 0)
        # Bytes past its end came before it was dispatched (pipelined): they were not searched.
        self._end = end if self._received <= end else None

    def finished(self, request: web.BaseRequest) -> None:
        """The application answered; bytes past the request's end are the next head's."""
        self._busy = False
        if self._end is None and not _framed(request) and request.content.is_eof():
            # A chunked body read to its end: bytes after it came before the answer, from a client that
            # pipelines. They are taken as this request's, so the connection idles as after any other
            # (held no longer than keepalive_timeout, as an idle one) and a next byte starts a head.
            self._end, self._head_end, self._tail = self._received, None, b""
        elif self._inner is not None and (self._end is None or self._received > self._end):
            self._arm()

    def _scan(self, data: bytes, start: int, end: int) -> None:
        skip = end - start if end > start else 0
        seg = self._tail + (data[skip:] if skip else data)
        base = start + skip - len(self._tail)
        crlf, lf = seg.find(b"\n\r\n"), seg.find(b"\n\n")
        if crlf < 0 and lf < 0:
            self._tail = seg[-2:]
        elif lf >= 0 and (crlf < 0 or lf < crlf):
            self._head_end, self._tail = base + lf + 2, b""
        else:
            self._head_end, self._tail = base + crlf + 3, b""

    # -- the deadline -----------------------------------------------------------------------

    def _arm(self) -> None:
        self._deadline = self._loop.time() + self._guard.head_timeout()
        self._mark = self._received
        timer = self._timer
        if timer is None or timer.when() > self._deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if not self._deadline or self._inner is None or transport is None:
            return
        if self._loop.time() < self._deadline:  # moved since the timer was set
            self._timer = self._loop.call_at(self._deadline, self._expire)
            return
        self._deadline = 0.0
        self._guard._note("head_timeout")
        end = self._end
        if self._received > self._mark or (end is not None and self._received > end):  # part of a head came
            text = f"request head not received within {self._guard.head_timeout():g} s\n".encode()
            transport.write(_ANSWER % (len(text), text))
        if transport.get_write_buffer_size():
            transport.abort()  # a client that does not read cannot hold the socket either
        else:
            transport.close()

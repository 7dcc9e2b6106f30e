"""Upstream connections of the fast path: asyncio Protocols in one keep-alive pool.

:class:`UpstreamConnection` sends one request at a time and parses the answer:
:meth:`~UpstreamConnection.exchange` resolves with the response head, after which
the body goes to a :class:`BodyConsumer` (bytes in ``data_received`` order, then
the end or the error). A body framed by ``Content-Length`` or chunked encoding,
on an HTTP/1.1 connection not marked ``close``, returns the connection to the
:class:`UpstreamPool` as soon as its last byte arrived. The read timeout
(``[proxy] timeout``) restarts with every read, as aiohttp's ``sock_read``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, cast

from yarl import URL

from geolimit.proxy.fast_wire import ChunkedDecoder, UpstreamHead, _WireError, response_head
from geolimit.proxy.state import Upstream

__all__ = ["BodyConsumer", "LazyDeadline", "UpstreamConnection", "UpstreamPool"]

MAX_HEAD = 64 * 1024
IDLE_SECONDS = 15.0  # a pooled connection idle longer is closed (aiohttp's keepalive_timeout)
MAX_IDLE = 256  # pooled connections per upstream


class _UpstreamClosed(ConnectionError):
    """The upstream closed the connection before the response was complete."""


class BodyConsumer(Protocol):
    def body_data(self, data: bytes) -> None: ...

    def body_done(self, exc: BaseException | None) -> None: ...


class LazyDeadline:
    """A moving deadline with one timer per connection: :meth:`_arm` sets it, and the timer is
    re-armed only when it must fire sooner or fires before the deadline (the subclass's
    ``_timed_out`` sees ``_deadline`` and calls the timer back when it is early)."""

    _loop: asyncio.AbstractEventLoop
    _timer: asyncio.TimerHandle | None
    _deadline: float

    def _timed_out(self) -> None:
        raise NotImplementedError

    def _arm(self, timeout: float) -> None:
        """The deadline ``timeout`` from now."""
        self._deadline = self._loop.time() + timeout
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._timed_out)
        elif self._timer.when() > self._deadline:
            self._timer.cancel()
            self._timer = self._loop.call_at(self._deadline, self._timed_out)


class UpstreamConnection(LazyDeadline, asyncio.Protocol):
    """One keep-alive connection to an upstream."""

    def __init__(self, pool: UpstreamPool, base: str) -> None:
        self.pool = pool
        self.base = base
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.received = False  # any byte of the current response
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._timeout = 30.0
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # of the read in progress; 0: none (the timer, if any, finds nothing to do)
        self._buf = b""
        self._method = "GET"
        self._head_waiter: asyncio.Future[UpstreamHead] | None = None
        self._head: UpstreamHead | None = None
        self._left = 0
        self._chunks: ChunkedDecoder | None = None
        self._pending: list[bytes] = []
        self._ended: BaseException | bool | None = False  # False: body not ended; None: ended well
        self._consumer: BodyConsumer | None = None
        self._reusable = False
        self._overrun = False  # more body than the head promised: never reuse this connection
        self._held = False

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._head_waiter is None and self._head is None:
            self._fail(_WireError("data from the upstream while no request was waiting"))
            return
        if self._deadline:
            self._deadline = self._loop.time() + self._timeout  # the timer looks at it when it fires
        if self._head is not None:
            self._body(data)
            return
        buf = self._buf + data if self._buf else data
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(_WireError("response head too large"))
                    return
                self._buf = buf
                return
            try:
                head = response_head(buf[:end + 4], self._method)
            except _WireError as exc:
                self._fail(exc)
                return
            buf = buf[end + 4:]
            if head.status < 200:
                if head.status == 101:
                    self._fail(_WireError("101 Switching Protocols without an Upgrade request"))
                    return
                continue  # an interim response (100, 103): the final one follows
            self._start_body(head)
        self._buf = b""
        if buf:
            self._body(buf)

    def eof_received(self) -> bool | None:
        return False  # close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None and self._ended is not False:
            self._timer.cancel()
            self._timer = None
        if self._head is not None and self._ended is False and self._head.length is None and not self._head.chunked:
            self._end(None)  # the body was delimited by the close
            return
        if self._head_waiter is not None or (self._head is not None and self._ended is False):
            self._fail(exc or _UpstreamClosed("the upstream closed the connection"))
        self.pool.forget(self)

    # -- the exchange --------------------------------------------------------------------

    def exchange(self, data: bytes, method: str, timeout: float) -> asyncio.Future[UpstreamHead]:
        """Send a whole request; the future resolves with the response head."""
        assert self.transport is not None
        assert self._head_waiter is None
        self._method = method
        self._timeout = timeout
        self._head = None
        self._chunks = None
        self._pending = []
        self._ended = False
        self._consumer = None
        self._reusable = False
        self._overrun = False
        self._held = False
        self.received = False
        waiter: asyncio.Future[UpstreamHead] = self._loop.create_future()
        self._head_waiter = waiter
        self._arm(timeout)
        if self.closed or self.transport.is_closing():
            # Reset since it was connected (an upstream that accepts and closes at once): uvloop's
            # write raises RuntimeError there, which failed the request with a traceback and no answer.
            self._fail(_UpstreamClosed("the upstream closed the connection before the request was sent"))
            return waiter
        self.transport.write(data)
        return waiter

    def consume(self, consumer: BodyConsumer) -> None:
        """Send the body (what arrived so far at once) to ``consumer``."""
        self._consumer = consumer
        pending, self._pending = self._pending, []
        for piece in pending:
            consumer.body_data(piece)
        if self._held:
            self._held = False
            self.resume()
        if self._ended is not False:
            self._settle()

    def take_body(self) -> bytes | None:
        """The whole body if it has arrived already (the connection goes back to the pool), else None."""
        if self._ended is not None or self._consumer is not None:
            return None
        body = b"".join(self._pending) if len(self._pending) != 1 else self._pending[0]
        self._pending = []
        self._settle()
        return body

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection (an exchange the client gave up)."""
        self._cancel_timer()
        self._consumer = None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self.pool.forget(self)

    # -- internals ------------------------------------------------------------------------

    def _start_body(self, head: UpstreamHead) -> None:
        self._head = head
        if head.chunked:
            self._chunks = ChunkedDecoder()
        elif head.length is not None:
            self._left = head.length
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(head)
        if head.length == 0:
            self._end(None)

    def _body(self, data: bytes) -> None:
        if self._ended is not False:
            self._fail(_WireError("data after the end of the response"))
            return
        head = self._head
        assert head is not None
        if self._chunks is not None:
            try:
                pieces = self._chunks.feed(data)
            except _WireError as exc:
                self._fail(exc)
                return
            for piece in pieces:
                self._deliver(piece)
            if self._chunks.done:
                self._end(None)
        elif head.length is not None:
            if len(data) > self._left:
                self._deliver(data[:self._left])
                self._left = 0
                self._overrun = True  # more than promised: never reuse this connection
                self._end(None)
                return
            self._left -= len(data)
            self._deliver(data)
            if self._left == 0:
                self._end(None)
        else:
            self._deliver(data)

    def _deliver(self, piece: bytes) -> None:
        if not piece:
            return
        if self._consumer is not None:
            self._consumer.body_data(piece)
            return
        self._pending.append(piece)
        if not self._held and sum(map(len, self._pending)) > MAX_HEAD * 4:
            self._held = True  # nobody reads yet: stop reading until someone does
            self.pause()

    def _end(self, exc: BaseException | None) -> None:
        self._cancel_timer()
        self._ended = exc
        self._reusable = (exc is None and self._head is not None and self._head.keep_alive and not self._overrun
                          and not self.closed)
        if not self._reusable and not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort() if exc is not None else self.transport.close()
        if self._consumer is not None:
            self._settle()

    def _settle(self) -> None:
        """The body ended and its consumer has it all: tell it; the connection goes back to the pool."""
        consumer, self._consumer = self._consumer, None
        ended = self._ended
        if self._reusable and not self.closed:
            self._head = None
            self.pool.release(self)
        if consumer is not None:
            consumer.body_done(ended if isinstance(ended, BaseException) else None)

    def _fail(self, exc: BaseException) -> None:
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            self._cancel_timer()
            waiter.set_exception(exc)
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)
        elif self._head is not None and self._ended is False:
            self.closed = True
            self._end(exc)
            if self.transport is not None:
                self.transport.abort()
        else:
            self.abort()

    def _timed_out(self) -> None:
        self._timer = None
        if not self._deadline:
            return
        now = self._loop.time()
        if now < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._timed_out)
            return
        self._deadline = 0.0
        self._fail(asyncio.TimeoutError())

    def _cancel_timer(self) -> None:
        self._deadline = 0.0


class UpstreamPool:
    """Idle keep-alive connections per upstream (most recently used first)."""

    def __init__(self) -> None:
        self._idle: dict[str, list[UpstreamConnection]] = {}
        self._addresses: dict[str, tuple[str, int]] = {}
        self._closed = False

    async def acquire(self, up: Upstream, connect_timeout: float) -> UpstreamConnection:
        """A pooled connection, or a new one (OSError, or TimeoutError after ``connect_timeout``)."""
        return self.idle(up) or await self.connect(up, connect_timeout)

    def idle(self, up: Upstream) -> UpstreamConnection | None:
        """A pooled connection (the most recently used that is still good), or None."""
        idle = self._idle.get(up.base)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_SECONDS:
                conn.reused = True
                return conn
            conn.abort()
        return None

    async def connect(self, up: Upstream, connect_timeout: float) -> UpstreamConnection:
        address = self._addresses.get(up.base)
        if address is None:
            url = URL(up.base)
            address = self._addresses[up.base] = (url.raw_host or "", url.port or 80)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: UpstreamConnection(self, up.base), *address), connect_timeout)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(conn.base, [])
        if self._closed or len(idle) >= MAX_IDLE:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            return
        # A relay may have paused its reading (the client's buffer was full) just as the body's
        # last bytes arrived; the client's resume then found no relay to pass it on. A paused
        # idle connection never reads the next answer: the next request on it hung until the
        # upstream timeout (a 504 after 30 s, or the test's 120 s).
        conn.resume()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        idle = self._idle.get(conn.base)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.closed = True
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()

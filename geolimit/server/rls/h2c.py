"""One unary gRPC method over HTTP/2 cleartext (prior knowledge), served by asyncio Protocols.

The fast transport of the rate limit service (``[region] rls_fast_path``, the
default; :mod:`geolimit.server.rls.transport`, grpcio's core, is the other): a
do-nothing call through grpcio's core costs about 55 us of CPU, this one a
fraction of that (docs/design.md §13). It speaks the part of HTTP/2 a gRPC client
uses, strictly: SETTINGS and their ACK, PING, flow control both ways (the peer's
windows and frame size respected when sending, the connection window replenished
as data arrives, a stream's window large enough for the largest message),
CONTINUATION, padding and priority, RST_STREAM, GOAWAY. A request is one
HEADERS block and one gRPC message (uncompressed, at most :data:`MAX_MESSAGE`
bytes); answers are precomputed frames (:mod:`geolimit.server.rls.h2wire`).

What it refuses: another method is ``UNIMPLEMENTED``, a compressed message
``UNIMPLEMENTED``, a message over the limit or a header list over
:data:`MAX_HEADER_LIST` ``RESOURCE_EXHAUSTED``, more than
:data:`MAX_STREAMS` open streams ``REFUSED_STREAM`` (a stream the client reset
while its call was being decided stays counted until the call ends, so a flood of
resets cannot pile up work: "rapid reset"). Bytes that break the
protocol end the connection with GOAWAY (``PROTOCOL_ERROR`` and the like), as
does a frame (or the preface) left incomplete for :data:`FRAME_TIMEOUT` seconds.
A request whose stream has not ended :data:`REQUEST_TIMEOUT` seconds after its
HEADERS (``[region] rls_request_timeout``) is answered ``DEADLINE_EXCEEDED`` and its
stream reset, its bytes released (:mod:`geolimit.server.rls.h2deadline`). At most
``max_connections`` connections are open (a :class:`~geolimit.http.connections.ListenerGuard`,
as the HTTP listeners'): one more is closed at its accept (a connection that has sent its
preface may idle for ever, as a gRPC client's does, unless it idles past ``rls_idle_timeout``:
a connection with no open stream that receives no frame, a PING included, for
:data:`~geolimit.server.rls.h2deadline.IDLE_TIMEOUT` seconds gets GOAWAY(``NO_ERROR``) and
is closed).
``grpc-timeout`` is ignored: the client cancels a late call itself (RST_STREAM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import cast

from geolimit.errors import GeolimitError
from geolimit.http.connections import ListenerGuard
from geolimit.server.rls.h2conn import H2Connection, Limits, RequestDeadline

__all__ = ["CLOCK", "FRAME_TIMEOUT", "MAX_HEADER_LIST", "MAX_MESSAGE", "MAX_STREAMS", "REQUEST_TIMEOUT", "FastCall",
           "FastServer"]

log = logging.getLogger("geolimit.agent")

MAX_MESSAGE = 4 * 1024 * 1024  # as grpcio's default receive limit
MAX_HEADER_LIST = 16 * 1024
MAX_STREAMS = 256
FRAME_TIMEOUT = 30.0
#: Seconds from a request's HEADERS to the end of its stream (the decision API's body deadline).
REQUEST_TIMEOUT = 10.0
#: The clock of request deadlines (monotonic seconds); tests inject their own.
CLOCK: Callable[[], float] = time.monotonic


class FastCall:
    """One call whose request message has arrived; answer it once, from the event loop."""

    __slots__ = ("_conn", "_stream", "request")

    def __init__(self, conn: H2Connection, stream: int, request: bytes) -> None:
        self._conn = conn
        self._stream = stream
        self.request = request

    def reply(self, message: bytes) -> None:
        """Answer OK with ``message`` (serialized); nothing if the stream or connection is gone."""
        self._conn.answer(self._stream, message)

    def fail(self, code: object, details: str) -> None:
        """Answer with gRPC status ``code`` (an int, or a grpcio status code value) and no message."""
        self._conn.fail(self._stream, int(cast(int, code)), details)


class FastServer:
    """Serves ``method`` (``/package.Service/Method``); ``handle`` runs in the loop and must not raise."""

    def __init__(self, method: str, handle: Callable[[FastCall], None], *, limits: Limits | None = None,
                 request_timeout: Callable[[], float] | None = None, timed_out: Callable[[int], None] | None = None,
                 clock: Callable[[], float] | None = None, guard: ListenerGuard | None = None,
                 idle_timeout: Callable[[], float] | None = None, idle_closed: Callable[[], None] | None = None) -> None:
        """``request_timeout()``: each new stream's deadline (default :data:`REQUEST_TIMEOUT`);
        ``timed_out(n)``: ``n`` requests were reset past it; ``clock``: default :data:`CLOCK`;
        ``guard``: the cap on open connections (none without it); ``idle_timeout()``: how long a
        connection without streams may go without a frame (default ``IDLE_TIMEOUT``);
        ``idle_closed()``: one was closed for it."""
        self.guard = guard
        self._method = method.encode()
        self._handle = handle
        self.limits = limits or Limits(MAX_MESSAGE, MAX_HEADER_LIST, MAX_STREAMS, FRAME_TIMEOUT)
        self.deadline = RequestDeadline(request_timeout or (lambda: REQUEST_TIMEOUT), clock or CLOCK, timed_out,
                                        idle_timeout, idle_closed)
        self._server: asyncio.Server | None = None
        self.connections: set[H2Connection] = set()
        self._all_gone: asyncio.Event | None = None
        self.closed = False

    async def listen(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Bind and accept; the bound port."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: H2Connection(self._method, self._dispatch, self.limits, self.connections, self._gone,
                                     self.deadline, self.guard),
                host, port, reuse_port=reuse_port or None, backlog=1024,
            )
        except OSError as exc:
            raise GeolimitError(f"cannot listen for gRPC on {host}:{port}: {exc}") from exc
        bound = int(self._server.sockets[0].getsockname()[1])
        if self.guard is not None:
            self.guard.where = f"{host}:{bound}"
        return bound

    def _gone(self) -> None:
        if self._all_gone is not None and not self.connections:
            self._all_gone.set()

    def _dispatch(self, conn: H2Connection, stream: int, request: bytes) -> None:
        call = FastCall(conn, stream, request)
        try:
            self._handle(call)
        except Exception:  # the handler must not raise: this call still gets an answer
            log.exception("rate limit service: the handler raised")
            conn.fail(stream, 13, "internal error")

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; GOAWAY to every client; calls in progress get ``grace`` seconds (None: none)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        self.closed = True
        server.close()
        self._all_gone = asyncio.Event()
        for conn in list(self.connections):
            conn.drain()  # each closes once its calls are answered
        if grace and self.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), grace)
        for conn in list(self.connections):
            conn.close()
        self.deadline.close()  # what its log holds back
        if self.guard is not None:
            self.guard.close()
        await server.wait_closed()

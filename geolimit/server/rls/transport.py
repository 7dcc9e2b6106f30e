"""One unary gRPC method served from grpcio's core, answered in an asyncio loop.

``grpc.aio`` and ``grpc.server`` wrap every call in Python machinery (a task or a
pool thread, a servicer context, several batches each awaited or waited on): on
this project's machines that costs 130-250 us of CPU per call before any work,
more than the agent's whole HTTP decision. This module drives grpcio's own core
(the ``grpc._cython.cygrpc`` layer that both of those servers are built on) with
the fewest steps a unary call needs:

1. a thread blocks on the completion queue (without the GIL); a new call is
   answered on that thread by asking for its one message, and the next call is
   requested at once;
2. the message is handed to the event loop (one wake-up for as many messages as
   arrived meanwhile), where the handler runs and later answers with
   :meth:`UnaryCall.reply` or :meth:`UnaryCall.fail`;
3. the answer is one batch: initial metadata, the message, the status, and the
   close.

HTTP/2, flow control, deadlines, compression and cancellation stay grpcio's; a
call to another method is ``UNIMPLEMENTED`` as grpcio's servers answer it.
``cygrpc`` is not grpcio's public API: :func:`check_core` verifies at start
that what this module uses is there and fails loudly otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from geolimit.errors import GeolimitError

__all__ = ["StatusCode", "UnaryCall", "UnaryServer", "check_core"]

log = logging.getLogger("geolimit.agent")

_core: Any
try:
    _core = importlib.import_module("grpc._cython.cygrpc")  # untyped, not grpcio's public API
except ImportError:  # pragma: no cover - grpcio without its core module
    _core = None

_NEEDED = ("Server", "CompletionQueue", "CompletionType", "StatusCode", "ReceiveMessageOperation",
           "SendInitialMetadataOperation", "SendMessageOperation", "SendStatusFromServerOperation",
           "ReceiveCloseOnServerOperation")


def check_core() -> Any:
    """grpcio's core module, or :class:`GeolimitError` if it lacks what this module uses."""
    missing = [name for name in _NEEDED if _core is None or not hasattr(_core, name)]
    if missing:
        raise GeolimitError(f"grpcio's core module (grpc._cython.cygrpc) lacks {', '.join(missing)}: "
                            "this grpcio version is not supported by the rate limit service")
    return _core


class StatusCode:
    """The status codes answered here (grpcio's core values)."""

    OK: Any = _core.StatusCode.ok if _core is not None else 0
    INVALID_ARGUMENT: Any = _core.StatusCode.invalid_argument if _core is not None else 3
    INTERNAL: Any = _core.StatusCode.internal if _core is not None else 13
    UNAVAILABLE: Any = _core.StatusCode.unavailable if _core is not None else 14
    UNIMPLEMENTED: Any = _core.StatusCode.unimplemented if _core is not None else 12


_REQUEST = object()  # the tag of the pending request for a new call
_SHUTDOWN = object()  # the tag of the server's shutdown
_RECEIVED = 1  # tags of a call's batches: (kind, call)
_DONE = 2


class UnaryCall:
    """One call whose request message has arrived; answer it once, from any thread."""

    __slots__ = ("_call", "_server", "request")

    def __init__(self, server: UnaryServer, call: Any, request: bytes) -> None:
        self._server = server
        self._call = call
        self.request = request

    def reply(self, message: bytes) -> None:
        """Answer OK with ``message`` (serialized); nothing once the server is closed."""
        if self._server.closed:
            return  # its queue is shut down: grpcio's core would abort the process on a new batch
        core = _core
        self._call.start_server_batch((
            core.SendInitialMetadataOperation(None, 0),
            core.SendMessageOperation(message, 0),
            core.SendStatusFromServerOperation(None, core.StatusCode.ok, b"", 0),
            core.ReceiveCloseOnServerOperation(0),
        ), (_DONE, self._call))

    def fail(self, code: Any, details: str) -> None:
        """Answer with status ``code`` (a :class:`StatusCode` value) and no message."""
        if not self._server.closed:
            _finish(self._call, code, details)


def _finish(call: Any, code: Any, details: str) -> None:
    core = _core
    call.start_server_batch((
        core.SendInitialMetadataOperation(None, 0),
        core.SendStatusFromServerOperation(None, code, details.encode("utf-8", "replace"), 0),
        core.ReceiveCloseOnServerOperation(0),
    ), (_DONE, call))


class UnaryServer:
    """Serves ``method`` (``/package.Service/Method``); ``handle`` runs in the loop of :meth:`start`.

    ``handle`` must not raise: it answers every call it is given, now or later.
    """

    def __init__(self, method: str, handle: Callable[[UnaryCall], None],
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self._method = method.encode()
        self._handle = handle
        self._options = tuple(options)
        self._server: Any = None
        self._queue: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque[UnaryCall] = deque()
        self._woken = False
        self._stopping = False
        self._shut_down: asyncio.Future[None] | None = None
        self._ended: asyncio.Future[None] | None = None
        self._crash: BaseException | None = None
        self._shutdown_seen = False  # by the poller
        self.closed = False  # set in the loop before the completion queue shuts down

    def bind(self, target: str) -> int:
        """Create the server and listen on ``target`` (``host:port``); the bound port."""
        core = check_core()
        if self._server is None:
            self._queue = core.CompletionQueue()
            self._server = core.Server(self._options, False)
            self._server.register_completion_queue(self._queue)
        port = int(self._server.add_http2_port(target.encode(), None))
        if port == 0:
            raise GeolimitError(f"cannot listen for gRPC on {target}")
        return port

    async def start(self) -> None:
        """Accept calls; ``handle`` runs in the running loop."""
        if self._server is None:
            raise GeolimitError("bind() first")
        if self._thread is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._shut_down = loop.create_future()
        self._ended = loop.create_future()
        self._server.start()
        self._server.request_call(self._queue, self._queue, _REQUEST)
        self._thread = threading.Thread(target=self._poll, name="geolimit-rls-poller", daemon=True)
        self._thread.start()

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; calls in progress get ``grace`` seconds (None: cancelled now); idempotent."""
        if self._thread is None or self._stopping:
            if self._ended is not None:
                await asyncio.shield(self._ended)
            return
        self._stopping = True
        assert self._shut_down is not None
        assert self._ended is not None
        server, queue = self._server, self._queue
        server.shutdown(queue, _SHUTDOWN)
        if grace is None:
            server.cancel_all_calls()
        either = (self._shut_down, self._ended)  # ended first only if the poller crashed
        if not any(f.done() for f in either):
            await asyncio.wait(either, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        if not any(f.done() for f in either):
            server.cancel_all_calls()
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        self.closed = True
        if self._crash is None:
            queue.shutdown()
            await self._ended
        else:  # nobody polls: wait for the shutdown here, then drain
            server.cancel_all_calls()
            await asyncio.to_thread(_drain_after_crash, queue, self._shutdown_seen)
        server.destroy()
        # grpcio's core shuts down (its threads too) once its last object is gone: keep none.
        self._server = self._queue = None
        if self._crash is not None:
            raise GeolimitError(f"the gRPC poller crashed: {self._crash!r}") from self._crash

    async def __aenter__(self) -> UnaryServer:
        """Start (after :meth:`bind`)."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(None)

    # -- the poller thread -----------------------------------------------------------

    def _poll(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a crash must not pass unseen: logged, and raised by stop()
            self._crash = exc
            log.critical("rate limit service: the gRPC poller crashed; no more calls are answered", exc_info=True)
        finally:
            self._to_loop(_set_result, self._ended)

    def _serve(self) -> None:
        core = _core
        queue_shutdown = core.CompletionType.queue_shutdown
        queue_timeout = core.CompletionType.queue_timeout
        receive = core.ReceiveMessageOperation
        while True:
            event = queue_poll(self._queue)
            kind = event.completion_type
            if kind == queue_shutdown:
                return
            if kind == queue_timeout:
                continue
            tag = event.tag
            if tag is _REQUEST:
                if not event.success:  # the server is shutting down
                    continue
                if not self._stopping:
                    self._server.request_call(self._queue, self._queue, _REQUEST)
                call = event.call
                if event.call_details.method != self._method:
                    _finish(call, core.StatusCode.unimplemented, "Method not found!")
                else:
                    call.start_server_batch((receive(0),), (_RECEIVED, call))
            elif tag is _SHUTDOWN:
                self._shutdown_seen = True
                self._to_loop(_set_result, self._shut_down)
            elif tag[0] == _RECEIVED:
                if not event.success:
                    continue  # cancelled before its message arrived
                message = event.batch_operations[0].message()
                if message is None:
                    _finish(tag[1], core.StatusCode.unimplemented, "exactly one request message is required")
                    continue
                self._inbox.append(UnaryCall(self, tag[1], message))
                if not self._woken:
                    self._woken = True
                    self._to_loop(self._drain)
            # (_DONE, call): the call is over, whether answered or cancelled; nothing to do

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(callback, *args)

    # -- the event loop ------------------------------------------------------------------

    def _drain(self) -> None:
        self._woken = False  # before draining: a message appended from now on wakes the loop again
        inbox, handle = self._inbox, self._handle
        while inbox:
            handle(inbox.popleft())


def queue_poll(queue: Any) -> Any:
    """The next event of ``queue`` (blocks without the GIL)."""
    return queue.poll()


def _drain_after_crash(queue: Any, shut_down: bool) -> None:
    """Poll ``queue`` until the server's shutdown, shut it down, and poll until it is empty."""
    core = _core
    if shut_down:
        queue.shutdown()
    while True:
        event = queue.poll()
        if event.completion_type == core.CompletionType.queue_shutdown:
            return
        if not shut_down and event.completion_type == core.CompletionType.operation_complete \
                and event.tag is _SHUTDOWN:
            shut_down = True
            queue.shutdown()


def _set_result(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)

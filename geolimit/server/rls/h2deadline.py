"""The timers of :class:`~geolimit.server.rls.h2conn.H2Connection`: an unfinished frame, an unfinished request.

A frame (or the preface) left incomplete for ``Limits.frame_timeout`` ends the
connection. A request whose HEADERS arrived but whose stream has not ended
(DATA still due) within :class:`RequestDeadline`'s seconds is answered
``DEADLINE_EXCEEDED`` (trailers only) and its stream reset (``NO_ERROR``, as for
every answer given before the client finished sending): its bytes are released
and the connection serves on. Without it, a client could hold 256 small unfinished
streams per connection until the connection closed, each under the byte budgets.

A connection with no open stream that receives nothing (not even a PING) for
:class:`RequestDeadline`'s ``idle()`` seconds (``[region] rls_idle_timeout``) gets
GOAWAY(``NO_ERROR``) and is closed: an idle connection would otherwise hold its
place under ``max_connections`` for ever. While a stream is open,
``rls_request_timeout`` governs it instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from geolimit.log_every import LogEvery
from geolimit.server.rls.h2send import Answering, Limits, Stream
from geolimit.server.rls.h2wire import Error

__all__ = ["IDLE_TIMEOUT", "LOG_EVERY", "RequestDeadline", "Timers"]

log = logging.getLogger("geolimit.agent")

#: Seconds between two log lines about requests past their deadline (the metric counts each).
LOG_EVERY = 10.0
#: Seconds a connection with no open stream may go without a frame (``[region] rls_idle_timeout``).
IDLE_TIMEOUT = 3900.0
_DEADLINE_EXCEEDED = 4  # the gRPC status of a request reset for taking too long to arrive


class RequestDeadline:
    """How long a request may take to arrive, on which clock, and the account of those that took longer.

    One per server: ``seconds`` is read for each stream as it opens (a reload applies
    to the streams opened after it); ``counted(n)`` gets each batch of resets (the
    agent's metric); the log says so at most once per :data:`LOG_EVERY` seconds.
    """

    def __init__(self, seconds: Callable[[], float], clock: Callable[[], float],
                 counted: Callable[[int], None] | None = None, idle: Callable[[], float] | None = None,
                 idle_counted: Callable[[], None] | None = None) -> None:
        self.seconds = seconds
        self.idle = idle or (lambda: IDLE_TIMEOUT)  #: read each time a connection's idle timer is set
        self._idle_counted = idle_counted
        self.idle_closed = 0  # connections closed for idling, in all
        self._idle_log = LogEvery(log, LOG_EVERY, level=logging.INFO)
        self.clock = clock
        self._counted = counted
        self.expired = 0  # requests reset, in all
        self._reset_log = LogEvery(log, LOG_EVERY, clock=clock)

    def idle_close(self, seconds: float, peer: object) -> None:
        """A connection from ``peer`` was closed after ``seconds`` idle."""
        self.idle_closed += 1
        if self._idle_counted is not None:
            self._idle_counted()
        self._idle_log.warn("idle", "rate limit service", f"closed an idle HTTP/2 connection from {peer} "
                            f"(no stream and no frame for {seconds:g} s)", "idle connection(s) closed")

    def close(self) -> None:
        """Write what the logs hold back."""
        self._reset_log.close()
        self._idle_log.close()

    def reset(self, n: int, seconds: float, peer: object) -> None:
        """``n`` requests from ``peer`` were reset past their deadline of ``seconds``."""
        self.expired += n
        if self._counted is not None:
            self._counted(n)
        self._reset_log.warn("reset", "rate limit service", f"reset {n} request(s) from {peer} not complete "
                             f"within {seconds:g} s", "request(s) reset", n)


class Timers(Answering):
    """The connection's timers; the attributes are :class:`H2Connection`'s."""

    _limits: Limits
    _deadline: RequestDeadline
    _partial_since: float
    _timer: asyncio.TimerHandle | None
    _next_due: float  # the earliest deadline of an unfinished request (it may have ended since)
    _due_timer: asyncio.TimerHandle | None
    _idle_timer: asyncio.TimerHandle | None

    # -- an idle connection ----------------------------------------------------------------

    def _active(self) -> None:
        """Bytes arrived: the connection's idle period starts again (the timer reads it when it fires)."""
        self._active_at = self._loop.time()
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_later(self._deadline.idle(), self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.closed or self._draining:
            return
        seconds = self._deadline.idle()
        now = self._loop.time()
        if self._streams or self._orphans:  # rls_request_timeout governs an open stream; idle from its end
            self._active_at = now
        late = self._active_at + seconds - now
        if late > 0:
            self._idle_timer = self._loop.call_later(late, self._check_idle)
            return
        self._deadline.idle_close(seconds, self.transport.get_extra_info("peername") if self.transport else None)
        self.drain()  # GOAWAY(NO_ERROR), then closed: no stream is open

    # -- an unfinished frame -------------------------------------------------------------

    def _partial(self) -> None:
        """Bytes of an unfinished frame (or preface) arrived: they must be completed in time."""
        self._partial_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_later(self._limits.frame_timeout, self._check_partial)

    def _check_partial(self) -> None:
        self._timer = None
        if self.closed or not self._partial_since:
            return
        late = self._partial_since + self._limits.frame_timeout - self._loop.time()
        if late <= 0:
            self._die(Error.PROTOCOL_ERROR, "a frame left incomplete")
        else:
            self._timer = self._loop.call_later(late, self._check_partial)

    # -- an unfinished request -----------------------------------------------------------

    def _opened(self, stream: Stream) -> None:
        """A request not complete with its HEADERS: it has until its deadline to end its stream."""
        now = self._deadline.clock()
        stream.allowed = self._deadline.seconds()
        stream.due = now + stream.allowed
        if stream.due < self._next_due:
            self._next_due = stream.due
            self._arm(now)

    def _arm(self, now: float) -> None:
        if self._due_timer is not None:
            self._due_timer.cancel()
        self._due_timer = self._loop.call_later(max(self._next_due - now, 0.0), self._on_due)

    def _on_due(self) -> None:
        self._due_timer = None
        if not self.closed:
            self._expire(self._deadline.clock())

    def _due_check(self) -> None:
        """After the frames of one read: requests past their deadline are reset now (the timer covers
        an idle connection; this one, a clock that moves in bigger steps than the loop's)."""
        if self._due_timer is not None:
            now = self._deadline.clock()
            if now >= self._next_due:
                self._expire(now)

    def _expire(self, now: float) -> None:
        late = [(sid, stream.allowed) for sid, stream in self._streams.items() if not stream.ended and stream.due <= now]
        if late:
            # Each stream's own deadline: a reload that changed rls_request_timeout since its
            # HEADERS does not change what it was given (nor what its answer says).
            for sid, allowed in late:
                self.fail(sid, _DEADLINE_EXCEEDED, f"request not complete within {allowed:g} s")
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            self._deadline.reset(len(late), max(allowed for _, allowed in late), peer)
        self._next_due = min((s.due for s in self._streams.values() if not s.ended), default=math.inf)
        if self._next_due < math.inf and not self.closed:
            self._arm(now)
        elif self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None

    def _stop_timers(self) -> None:
        for timer in (self._timer, self._due_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._due_timer = self._idle_timer = None

"""The timers of :class:`~geolimit.server.rls.h2conn.H2Connection`: an unfinished frame, an unfinished request.

A frame (or the preface) left incomplete for ``Limits.frame_timeout`` ends the
connection. A request whose HEADERS arrived but whose stream has not ended
(DATA still due) within :class:`RequestDeadline`'s seconds is answered
``DEADLINE_EXCEEDED`` (trailers only) and its stream reset (``NO_ERROR``, as for
every answer given before the client finished sending): its bytes are released
and the connection serves on. Without it, a client could hold 256 small unfinished
streams per connection until the connection closed, each under the byte budgets.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from geolimit.server.rls.h2send import Answering, Limits, Stream
from geolimit.server.rls.h2wire import Error

__all__ = ["LOG_EVERY", "RequestDeadline", "Timers"]

log = logging.getLogger("geolimit.agent")

#: Seconds between two log lines about requests past their deadline (the metric counts each).
LOG_EVERY = 10.0
_DEADLINE_EXCEEDED = 4  # the gRPC status of a request reset for taking too long to arrive


class RequestDeadline:
    """How long a request may take to arrive, on which clock, and the account of those that took longer.

    One per server: ``seconds`` is read for each stream as it opens (a reload applies
    to the streams opened after it); ``counted(n)`` gets each batch of resets (the
    agent's metric); the log says so at most once per :data:`LOG_EVERY` seconds.
    """

    def __init__(self, seconds: Callable[[], float], clock: Callable[[], float],
                 counted: Callable[[int], None] | None = None) -> None:
        self.seconds = seconds
        self.clock = clock
        self._counted = counted
        self.expired = 0  # requests reset, in all
        self._logged = -math.inf
        self._held = 0  # resets not logged since the last line

    def reset(self, n: int, seconds: float, peer: object) -> None:
        """``n`` requests from ``peer`` were reset past their deadline of ``seconds``."""
        self.expired += n
        if self._counted is not None:
            self._counted(n)
        now = self.clock()
        if now - self._logged < LOG_EVERY:
            self._held += n
            return
        more = f" ({self._held} more in the last {LOG_EVERY:g} s)" if self._held else ""
        self._logged, self._held = now, 0
        log.warning("rate limit service: reset %d request(s) from %s not complete within %g s%s",
                    n, peer, seconds, more)


class Timers(Answering):
    """The connection's timers; the attributes are :class:`H2Connection`'s."""

    _limits: Limits
    _deadline: RequestDeadline
    _partial_since: float
    _timer: asyncio.TimerHandle | None
    _next_due: float  # the earliest deadline of an unfinished request (it may have ended since)
    _due_timer: asyncio.TimerHandle | None

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
        stream.due = now + self._deadline.seconds()
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
        late = [sid for sid, stream in self._streams.items() if not stream.ended and stream.due <= now]
        if late:
            seconds = self._deadline.seconds()
            for sid in late:
                self.fail(sid, _DEADLINE_EXCEEDED, f"request not complete within {seconds:g} s")
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            self._deadline.reset(len(late), seconds, peer)
        self._next_due = min((s.due for s in self._streams.values() if not s.ended), default=math.inf)
        if self._next_due < math.inf and not self.closed:
            self._arm(now)
        elif self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None

    def _stop_timers(self) -> None:
        for timer in (self._timer, self._due_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._due_timer = None

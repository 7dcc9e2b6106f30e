"""At most one log line per key every ``every`` seconds, counting what it held back.

Something that can happen on every request (a peer retrying with the wrong secret,
an upstream that is down while thousands of requests a second go to it) would write
a line per request. :class:`LogEvery` writes the first one of a key at once, holds
back the others of the next ``every`` seconds, and then writes one line that counts
them and gives the latest one's detail::

    upstream http://127.0.0.1:9: cannot connect: [Errno 111] Connection refused
    upstream http://127.0.0.1:9: 1999 more request(s) could not connect in the last 10 s (latest: cannot connect: ...)

That line is written when the period is over (a timer on the running event loop,
if there is one), or by the key's next event, whichever comes first; :meth:`close`
writes what is still held back. What is counted elsewhere (a metric per event) is
not this module's business: the log only summarizes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["EVERY", "MAX_KEYS", "LogEvery"]

EVERY = 10.0  #: seconds between two lines of one key
MAX_KEYS = 1024  #: keys remembered (a flood of sources cannot grow the table)


@dataclass(slots=True)
class _Key:
    last: float  # when the key's last line was written
    held: int = 0  # events since then not written
    subject: str = ""  # of the latest held-back event
    detail: str = ""
    what: str = ""


class LogEvery:
    """``warn(key, subject, detail, what)``: ``"<subject>: <detail>"`` at most once per ``every``
    seconds per ``key``; the events held back meanwhile become
    ``"<subject>: <n> more <what> in the last <s> s (latest: <detail>)"``."""

    def __init__(self, log: logging.Logger, every: float = EVERY, *, clock: Callable[[], float] = time.monotonic,
                 level: int = logging.WARNING, max_keys: int = MAX_KEYS) -> None:
        self.log = log
        self.every = every
        self.clock = clock  #: replaceable (tests)
        self.level = level
        self.max_keys = max_keys
        self._keys: dict[Hashable, _Key] = {}
        self._timer: asyncio.Handle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._timer_due = 0.0  # loop time

    def warn(self, key: Hashable, subject: str, detail: str, what: str, n: int = 1) -> bool:
        """One event of ``key`` (``n`` of them at once: a held-back batch counts ``n``); True if a
        line was written for it now."""
        now = self.clock()
        entry = self._keys.get(key)
        if entry is not None and now - entry.last < self.every:
            entry.held += n
            entry.subject, entry.detail, entry.what = subject, detail, what
            self._schedule(entry.last + self.every - now)
            return False
        if entry is None:
            if len(self._keys) >= self.max_keys:
                self._forget(now)
            self._keys[key] = _Key(now)
        elif entry.held:  # its period is over and the timer has not written the count yet: this one joins it
            entry.held += n
            entry.subject, entry.detail, entry.what = subject, detail, what
            self._write_held(entry, now)
            return True
        else:
            entry.last = now
        self.log.log(self.level, "%s: %s", subject, detail)
        return True

    def flush(self) -> None:
        """Write the count of every key whose period is over; forget the keys gone quiet."""
        now = self.clock()
        due: float | None = None  # the earliest period still running with events held back
        for key, entry in list(self._keys.items()):
            left = entry.last + self.every - now
            if left > 0:
                if entry.held and (due is None or left < due):
                    due = left
            elif entry.held:
                self._write_held(entry, now)
            else:
                del self._keys[key]  # as if never seen: its next event is written at once
        if due is not None:
            self._schedule(due)

    def close(self) -> None:
        """Write every count still held back (whatever its period) and stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_loop = None
        now = self.clock()
        for entry in self._keys.values():
            if entry.held:
                self._write_held(entry, now)

    def _write_held(self, entry: _Key, now: float) -> None:
        self.log.log(self.level, "%s: %d more %s in the last %.0f s (latest: %s)", entry.subject, entry.held,
                     entry.what, now - entry.last, entry.detail)
        entry.last, entry.held = now, 0

    def _forget(self, now: float) -> None:
        """Room for keys: the quiet ones go; if that is not a quarter, the oldest quarter (counts with them)."""
        for key, entry in list(self._keys.items()):
            if not entry.held and now - entry.last >= self.every:
                del self._keys[key]
        if len(self._keys) > self.max_keys * 3 // 4:
            for key in list(self._keys)[:max(1, self.max_keys // 4)]:
                del self._keys[key]

    def _schedule(self, delay: float) -> None:
        """A :meth:`flush` ``delay`` seconds from now, on the running loop (none without one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # the key's next event writes the count
        due = loop.time() + max(delay, 0.0)
        if self._timer is not None and self._timer_loop is loop:
            if self._timer_due <= due:
                return  # it fires soon enough
            self._timer.cancel()
        # uvloop gives a plain Handle (no when()) for a delay under a millisecond: the due time is kept here
        self._timer, self._timer_loop, self._timer_due = loop.call_at(due, self._fire), loop, due

    def _fire(self) -> None:
        self._timer = self._timer_loop = None
        self.flush()

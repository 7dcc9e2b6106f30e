"""Reading a peer's request body before it can be authenticated, without letting
anyone who reaches the port hold the agent's memory or its connections.

A body is read within a deadline (the gossip ``timeout``: the sender has given up by
then; 408) and within a byte budget shared by the bodies being read at once
(``bodies`` messages of the cap; 503 ``busy`` beyond it, before reading: the sender
retries). Either answer ends the keep-alive: aiohttp reads on and drops what the
client still sends for its lingering time (10 s), then closes the connection (no
memory held meanwhile). A body over the cap gets 413. A peer
that resets mid-body gets counted and logged once per period (``RefusalLog``),
not a traceback per connection. See docs/design.md §12.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from geolimit.errors import ProtocolError
from geolimit.replication.refusals import RefusalLog
from geolimit.replication.transport import read_limited

__all__ = ["BodyGuard", "Refusal", "error_response"]


def error_response(status: int, reason: str, message: str, close: bool = False) -> web.Response:
    """``{"error": message, "reason": reason}``; ``close``: then close the connection."""
    response = web.json_response({"error": message, "reason": reason}, status=status)
    if close:
        response.force_close()
    return response


@dataclass(frozen=True)
class Refusal:
    """Why a body was not read: the HTTP ``status``, the metric ``reason`` (``too_large``,
    ``busy``, ``slow_body``, ``disconnected``) and the words for the client."""

    status: int
    reason: str
    message: str

    @property
    def close(self) -> bool:
        """The body was not read whole: end the keep-alive."""
        return self.status != 413


class BodyGuard:
    """``await guard.read(request)``: the body, or the answer to give instead
    (``read_raw``: the body or a :class:`Refusal`, for routes with their own error format)."""

    def __init__(self, what: str, cap: int, timeout: Callable[[], float], refusals: RefusalLog,
                 rejected: Callable[[str], None] = lambda reason: None, bodies: int = 4) -> None:
        self.what, self.cap, self._timeout = what, cap, timeout
        self._refusals, self._rejected = refusals, rejected
        self.budget = bodies * cap
        self.reading = 0  # bytes reserved by the bodies being read now

    async def read(self, request: web.Request) -> bytes | web.Response:
        got = await self.read_raw(request)
        if isinstance(got, Refusal):
            return error_response(got.status, got.reason, got.message, close=got.close)
        return got

    async def read_raw(self, request: web.Request) -> bytes | Refusal:
        cap, what = self.cap, self.what
        if request.content_length is not None and request.content_length > cap:
            return self._refused(413, "too_large", f"{what} body over {cap} bytes")
        want = cap if request.content_length is None else request.content_length
        if self.reading + want > self.budget:
            return self._refused(503, "busy", f"{what} bodies of {self.reading} bytes are being read; send again")
        self.reading += want
        timeout = self._timeout()
        try:
            body = await asyncio.wait_for(read_limited(request.content, cap), timeout)
        except asyncio.TimeoutError:
            self._refusals.warn(what, request.remote, ProtocolError(f"body not received within {timeout:g} s"))
            return self._refused(408, "slow_body", f"{what} body not received within {timeout:g} s")
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            self._refusals.warn(what, request.remote, ProtocolError(f"connection lost mid-body ({type(exc).__name__})"))
            return self._refused(400, "disconnected", "connection lost mid-body")
        finally:
            self.reading -= want
        if body is None:
            return self._refused(413, "too_large", f"{what} body over {cap} bytes")
        return body

    def _refused(self, status: int, reason: str, message: str) -> Refusal:
        self._rejected(reason)
        return Refusal(status, reason, message)

"""Reading a decision API request's JSON body within a deadline and a byte budget.

Without a token (the default) anyone who reaches the API port can send bodies: 300
connections that each declared 1 MiB and sent all but one byte took an agent from 77
to 516 MiB for good, 500 chunked bodies that never end stayed open, and 2000 clients
resetting mid-body wrote 38,000 lines of tracebacks. A body is now read within
:data:`BODY_SECONDS` (408), within a budget of :data:`BODIES_IN_FLIGHT` bodies of
:data:`MAX_BODY` being read at once by the agent (503, before reading), and a client
that drops the connection mid-body is logged once per 10 s per source, not a traceback:
the same :class:`~geolimit.replication.body_guard.BodyGuard` as the gossip port's.
"""

from __future__ import annotations

import json

from aiohttp import web

from geolimit.errors import BadRequest
from geolimit.replication.body_guard import BodyGuard, Refusal
from geolimit.replication.refusals import RefusalLog

__all__ = ["BODIES_IN_FLIGHT", "BODY_SECONDS", "MAX_BODY", "body_guard", "read_json_body"]

MAX_BODY = 1024 * 1024
#: Seconds a request body may take to arrive.
BODY_SECONDS = 10.0
#: Bodies of MAX_BODY that may be read at once (their bytes, over all connections).
BODIES_IN_FLIGHT = 64


class _ClientGone(Exception):
    """The client dropped the connection before its body arrived: there is no one to answer."""


def body_guard(refusals: RefusalLog) -> BodyGuard:
    """The guard of one agent's API (its byte budget: :data:`BODIES_IN_FLIGHT` bodies of :data:`MAX_BODY`)."""
    return BodyGuard("API request", MAX_BODY, lambda: BODY_SECONDS, refusals, bodies=BODIES_IN_FLIGHT)


async def read_json_body(request: web.Request, guard: BodyGuard) -> object:
    """The body as JSON; :class:`BadRequest` (400, 408, 413, 503) or :class:`_ClientGone`."""
    raw = await guard.read_raw(request)
    if isinstance(raw, Refusal):
        if raw.reason == "disconnected":  # logged once per period by the guard
            raise _ClientGone
        raise BadRequest(raw.message, "body", status=raw.status)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"body is not valid JSON: {str(exc)[:200]}", "body") from None

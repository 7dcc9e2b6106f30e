"""Reading a decision API request's JSON body within a deadline and a byte budget.

Without a token (the default) anyone who reaches the API port can send bodies: 300
connections that each declared 1 MiB and sent all but one byte took an agent from 77
to 516 MiB for good, 500 chunked bodies that never end stayed open, and 2000 clients
resetting mid-body wrote 38,000 lines of tracebacks. A body is now read within
:data:`BODY_SECONDS` (408), within a budget of :data:`BODIES_IN_FLIGHT` bodies of
:data:`MAX_BODY` being read at once in this process (503, before reading), and a client
that drops the connection mid-body is logged once per 10 s per source, not a traceback.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from geolimit.errors import BadRequest, ProtocolError
from geolimit.replication.refusals import RefusalLog

__all__ = ["BODIES_IN_FLIGHT", "BODY_SECONDS", "MAX_BODY", "read_json_body"]

MAX_BODY = 1024 * 1024
#: Seconds a request body may take to arrive.
BODY_SECONDS = 10.0
#: Bodies of MAX_BODY that may be read at once (their bytes, over all connections).
BODIES_IN_FLIGHT = 64


class _ClientGone(Exception):
    """The client dropped the connection before its body arrived: there is no one to answer."""


class _Budget:
    reading = 0  # bytes reserved by the bodies being read now


_budget = _Budget()


async def _read_all(request: web.Request) -> bytearray:
    # StreamReader.read(n) returns what has arrived so far: keep reading until EOF.
    raw = bytearray()
    while True:
        chunk = await request.content.read(MAX_BODY + 1 - len(raw))
        if not chunk:
            return raw
        raw += chunk
        if len(raw) > MAX_BODY:
            raise BadRequest(f"body over {MAX_BODY} bytes", "body", status=413)


async def read_json_body(request: web.Request, refusals: RefusalLog) -> object:
    """The body as JSON; :class:`BadRequest` (400, 408, 413, 503) or :class:`_ClientGone`."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise BadRequest(f"body over {MAX_BODY} bytes", "body", status=413)
    want = MAX_BODY if request.content_length is None else request.content_length
    if _budget.reading + want > BODIES_IN_FLIGHT * MAX_BODY:
        raise BadRequest("too many request bodies are being read; send again", "body", status=503)
    _budget.reading += want
    try:
        raw = await asyncio.wait_for(_read_all(request), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise BadRequest(f"body not received within {BODY_SECONDS:g} s", "body", status=408) from None
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        refusals.warn("API request", request.remote, ProtocolError(f"connection lost mid-body ({type(exc).__name__})"))
        raise _ClientGone from None
    finally:
        _budget.reading -= want
    try:
        return json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"body is not valid JSON: {str(exc)[:200]}", "body") from None

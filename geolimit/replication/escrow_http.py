"""Escrow messages over HTTP: ``POST /v1/escrow``, signed like gossip.

The route checks, in order, as ``/v1/gossip`` does: size (413), authentication
(401), decoding and every key's fields (400, nothing written; ``reason``
``own_transfer``: a push claiming this region gave more than it recorded,
``over_limit``: transfers giving it rights above the limit), then the replay
guard, then Redis (503 when it fails). Responses are signed for the requester
with the request's sequence number.
"""

from __future__ import annotations

import logging
import ssl
from typing import Protocol

import aiohttp
from aiohttp import web

from geolimit.errors import (
    AuthenticationError,
    ClockSkewError,
    ProtocolError,
    StorageError,
)
from geolimit.replication import escrow_wire
from geolimit.replication.auth import SEQ, Signer, Verifier
from geolimit.replication.body_guard import BodyGuard, error_response
from geolimit.replication.escrow import EscrowReplicator
from geolimit.replication.escrow_io import refusal_reason
from geolimit.replication.escrow_wire import ESCROW_PATH, EscrowMessage
from geolimit.replication.refusals import RefusalLog
from geolimit.replication.transport import (
    CONTENT_TYPE,
    ClockRefusals,
    clock_refused,
    post_signed,
)

__all__ = ["EscrowHttpTransport", "add_escrow_routes"]

log = logging.getLogger("geolimit.escrow")


class EscrowHttpTransport:
    """Posts signed escrow messages to ``<peer url>/v1/escrow`` and verifies the signed answer."""

    def __init__(self, urls: dict[str, str], signer: Signer, verifier: Verifier, timeout: float = 2.0,
                 ssl_context: ssl.SSLContext | None = None, max_response_bytes: int = 64 * 1024 * 1024) -> None:
        self._urls = {name: url.rstrip("/") + ESCROW_PATH for name, url in urls.items()}
        self._signer = signer
        self._verifier = verifier
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._ssl = ssl_context
        self._max_response = max_response_bytes
        self._session: aiohttp.ClientSession | None = None

    def set_url(self, peer: str, url: str) -> None:
        self._urls[peer] = url.rstrip("/") + ESCROW_PATH

    async def send(self, peer: str, message: EscrowMessage) -> EscrowMessage:
        body = escrow_wire.encode(message)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(
                ssl=self._ssl if self._ssl is not None else True))
        payload, reply_headers, seq = await post_signed(
            self._session, self._urls[peer], peer, body, self._signer, self._max_response,
            answer="an escrow answer", message="the escrow message")
        await self._verifier.verify_response_async(reply_headers, payload, expect_seq=seq, sender=peer)
        reply = escrow_wire.decode(payload)
        if reply.sender != peer or reply.kind not in ("ack", "page"):
            raise ProtocolError(f"escrow answer from {peer} is not an ack or page from it")
        return reply

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None


class EscrowAgent(Protocol):
    """What the route needs from the agent."""

    signer: Signer
    verifier: Verifier
    escrow: EscrowReplicator | None

    @property
    def engine(self) -> ClockRefusals | None: ...

    @property
    def max_message_bytes(self) -> int: ...

    @property
    def body_timeout(self) -> float:
        """Seconds a peer's body may take to arrive (the gossip timeout)."""



def add_escrow_routes(app: web.Application, agent: EscrowAgent) -> None:
    refusals = RefusalLog(log)
    bodies = BodyGuard("escrow message", agent.max_message_bytes, lambda: agent.body_timeout, refusals)

    async def escrow(request: web.Request) -> web.StreamResponse:
        body = await bodies.read(request)  # within a deadline and a byte budget (body_guard.py)
        if isinstance(body, web.Response):
            return body
        try:
            auth = await agent.verifier.authenticate_async(request.headers, body)
        except ClockSkewError as exc:
            return clock_refused(agent.engine, exc)
        except AuthenticationError as exc:
            refusals.warn("escrow message", request.remote, exc)
            return error_response(401, "auth", str(exc))
        replicator = agent.escrow
        if replicator is None:
            return error_response(503, "starting", "agent is starting")
        try:
            message = escrow_wire.decode(body)
            if message.sender != auth.sender:
                raise ProtocolError(f"body says it is from {message.sender!r}, headers say {auth.sender!r}")
            reply = await replicator.receive(message, admit=lambda: agent.verifier.check_replay(auth))
        except AuthenticationError as exc:
            refusals.warn("escrow message", auth.sender, exc)
            return error_response(401, "auth", str(exc))
        except ProtocolError as exc:
            replicator.stats["refused"] += 1
            refusals.warn("escrow message", auth.sender, exc)
            return error_response(400, refusal_reason(exc), str(exc))
        except StorageError as exc:
            return error_response(503, "redis", str(exc))
        payload = escrow_wire.encode(reply)
        headers = agent.signer.headers(payload, auth.sender, seq=int(request.headers[SEQ]), response=True)
        headers["Content-Type"] = CONTENT_TYPE
        return web.Response(body=payload, headers=headers)

    app.router.add_post(ESCROW_PATH, escrow)

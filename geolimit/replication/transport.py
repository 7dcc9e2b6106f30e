"""How gossip messages travel between agents.

:class:`HttpTransport` posts signed msgpack bodies to ``<peer url>/v1/gossip``
with aiohttp and verifies the signed response. Tests and the simulator plug in
other transports with the same two methods.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from geolimit.errors import ClockSkewError, PeerRefused, ProtocolError, TransportError
from geolimit.replication import wire
from geolimit.replication.auth import SEQ, Signer, Verifier

__all__ = ["HttpTransport", "PeerRefused", "Transport", "TransportError", "clock_refused", "post_signed", "read_limited"]


class ClockRefusals(Protocol):
    """Where refusals for a skewed clock are recorded (the gossip engine)."""

    def note_clock_refused(self, peer_name: str, offset: float) -> None: ...


def clock_refused(engine: ClockRefusals | None, exc: ClockSkewError) -> web.Response:
    """The 401 for a signed message whose time is outside the auth window, recorded
    (and logged) against its peer, so that ``/v1/status`` and the metrics show the offset."""
    if engine is not None:
        engine.note_clock_refused(exc.peer, exc.offset)
    return web.json_response({"error": str(exc), "reason": "clock_skew", "offset": round(exc.offset, 3)}, status=401)

GOSSIP_PATH = "/v1/gossip"
CONTENT_TYPE = "application/msgpack"


async def read_limited(stream: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None as soon as it exceeds ``limit`` bytes.

    ``StreamReader.read(n)`` returns what is buffered, not ``n`` bytes, so a large
    body has to be read in a loop.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await stream.read(min(1 << 20, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


def error_body(payload: bytes) -> tuple[str | None, str]:
    """A peer's error answer: the ``reason`` of its JSON body (``{"error": ..., "reason":
    "auth"}``; None if it has none) and what it says (its ``error``, else the first 200 bytes)."""
    raw = payload[:200].decode("utf-8", "replace")
    try:
        body = json.loads(payload[:4096])
    except ValueError:
        return None, raw
    if not isinstance(body, dict):
        return None, raw
    reason, error = body.get("reason"), body.get("error")
    reason = reason[:64] if isinstance(reason, str) else None
    if not isinstance(error, str):
        return reason, raw
    return reason, f"{error[:300]} ({reason})" if reason else error[:300]


async def post_signed(
    session: aiohttp.ClientSession, url: str, peer: str, body: bytes, signer: Signer, max_response: int,
    answer: str = "a response", message: str = "the message",
) -> tuple[bytes, CIMultiDict[str], int]:
    """POST ``body`` signed for ``peer``: the answer's body and headers and the request's
    sequence number (for ``Verifier.verify_response``). Raises TransportError (unreachable,
    an answer over ``max_response`` bytes, a status other than 200 and 400) or PeerRefused (400),
    with the peer's status and the ``reason`` of its error body."""
    headers = signer.headers(body, peer)
    headers["Content-Type"] = CONTENT_TYPE
    seq = int(headers[SEQ])
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            payload = await read_limited(resp.content, max_response)
            if payload is None:
                raise TransportError(f"{peer} sent {answer} over {max_response} bytes")
            if resp.status != 200:
                reason, detail = error_body(payload)
                if resp.status == 400:
                    raise PeerRefused(f"{peer} refused {message}: {detail}", resp.status, reason)
                raise TransportError(f"{peer} answered HTTP {resp.status}: {detail}", resp.status, reason)
            return payload, CIMultiDict(resp.headers), seq
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise TransportError(f"{peer} unreachable: {type(exc).__name__}: {exc}") from exc


class Transport(Protocol):
    async def send(self, peer: str, message: wire.Message) -> wire.Message:
        """Deliver ``message`` to ``peer`` and return its (verified) response."""

    async def close(self) -> None: ...


class HttpTransport:
    """Signed msgpack over HTTP(S) with aiohttp.

    Deltas share one client session (a pool of connections per peer). Anti-entropy
    steps (kind ``"ae"``) go over a second session that keeps a single keep-alive
    connection per peer, so every step of an exchange reaches the same process:
    with several agent workers behind one port (SO_REUSEPORT) the responder's
    state lives in the worker that got the exchange's ``begin``. If that
    connection drops mid-exchange, the next step may reach another worker, which
    answers "unknown or expired exchange"; the run fails and is retried later.
    """

    def __init__(
        self,
        urls: dict[str, str],
        signer: Signer,
        verifier: Verifier,
        timeout: float = 2.0,
        ssl_context: ssl.SSLContext | None = None,
        max_response_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._urls = {name: url.rstrip("/") + GOSSIP_PATH for name, url in urls.items()}
        self._signer = signer
        self._verifier = verifier
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._ssl = ssl_context
        self._max_response = max_response_bytes
        self._session: aiohttp.ClientSession | None = None
        self._pinned: aiohttp.ClientSession | None = None  # anti-entropy: one connection per peer
        self.bytes_sent: dict[str, int] = dict.fromkeys(urls, 0)

    def set_url(self, peer: str, url: str) -> None:
        self._urls[peer] = url.rstrip("/") + GOSSIP_PATH

    def _client(self, pinned: bool = False) -> aiohttp.ClientSession:
        if pinned:
            if self._pinned is None or self._pinned.closed:
                # One connection per peer, kept alive between steps (below the server's 75 s).
                self._pinned = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(
                    ssl=self._ssl if self._ssl is not None else True, limit_per_host=1, keepalive_timeout=60.0,
                ))
            return self._pinned
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True),
            )
        return self._session

    async def send(self, peer: str, message: wire.Message) -> wire.Message:
        body = wire.encode(message)
        payload, reply_headers, seq = await post_signed(
            self._client(message.kind == "ae"), self._urls[peer], peer, body, self._signer, self._max_response)
        self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + len(body)
        await self._verifier.verify_response_async(reply_headers, payload, expect_seq=seq, sender=peer)
        reply = wire.decode(payload)
        if reply.sender != peer:
            raise ProtocolError(f"response from {peer} claims to come from {reply.sender!r}")
        self._verifier.check_body_time(reply.now_us)
        return reply

    async def close(self) -> None:
        for session in (self._session, self._pinned):
            if session is not None:
                await session.close()
        self._session = self._pinned = None

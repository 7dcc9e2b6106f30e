"""``POST /v1/gossip``: where peers deliver signed msgpack messages.

Checks run in this order, and a request that fails one never reaches Redis:

1. size: a body over the cap gets 413 before anything is decoded (``Content-Length``
   first, then a bounded read). Bodies are read within a deadline (the gossip
   ``timeout``, after which the sender has given up: 408) and within a budget of
   bytes being read at once over all connections (4 messages of the cap: 503
   ``busy`` beyond it, the sender retries), so slow or never-finished bodies
   cannot hold the agent's memory; a peer that drops the connection mid-body is
   counted, not logged with a traceback (``replication/body_guard.py``);
2. authentication: unsigned, forged, replayed (the guard is in Redis, so it
   survives restarts), stale or misaddressed messages get 401 (``clock_skew`` when
   a correctly signed message's time is outside the auth window: logged with the
   peer's offset, counted in ``/v1/status`` and ``geolimit_peer_clock_refusals``);
3. decoding: malformed msgpack or an invalid message gets 400 (a body time ``now``
   outside the auth window too: it moves the agreed clock); so do cells that
   ``merge.lua`` refuses (out of range, unknown regions' slots, the receiver's own
   slot, too many new slot ids or cells), with nothing written.

The response is the engine's reply, signed with the request's sequence number.
"""

from __future__ import annotations

import logging

from aiohttp import web

from geolimit.errors import AuthenticationError, ClockSkewError, ProtocolError, StorageError
from geolimit.replication import wire
from geolimit.replication.auth import SEQ
from geolimit.replication.body_guard import BodyGuard, error_response
from geolimit.replication.refusals import RefusalLog
from geolimit.replication.transport import CONTENT_TYPE, GOSSIP_PATH, clock_refused
from geolimit.server.routes_protocol import GossipAgent

__all__ = ["add_gossip_routes"]

log = logging.getLogger("geolimit.agent")



def add_gossip_routes(app: web.Application, agent: GossipAgent) -> None:
    refusals = RefusalLog(log)
    bodies = BodyGuard("gossip", agent.config.max_message_bytes, lambda: agent.config.timeout, refusals,
                       lambda reason: agent.metrics.rejected.labels(reason).inc())

    async def gossip(request: web.Request) -> web.StreamResponse:
        metrics = agent.metrics
        body = await bodies.read(request)
        if isinstance(body, web.Response):
            return body
        try:
            auth = await agent.verifier.authenticate_async(request.headers, body)
        except ClockSkewError as exc:
            metrics.rejected.labels("clock_skew").inc()
            return clock_refused(agent.engine, exc)
        except AuthenticationError as exc:
            metrics.rejected.labels("auth").inc()
            refusals.warn("gossip", request.remote, exc)
            return error_response(401, "auth", str(exc))
        sender = auth.sender
        try:
            message = wire.decode(body)
            if message.sender != sender:
                raise ProtocolError(f"body says it is from {message.sender!r}, headers say {sender!r}")
            agent.verifier.check_body_time(message.now_us)
        except ProtocolError as exc:
            metrics.rejected.labels("decode").inc()
            refusals.warn("gossip", sender, exc)
            return error_response(400, "decode", str(exc))
        engine = agent.engine
        if engine is None:
            return error_response(503, "starting", "agent is starting")
        try:
            # The replay guard runs last, after every check: a refused message leaves no trace.
            reply = await engine.receive(message, admit=lambda: agent.verifier.check_replay(auth))
        except StorageError as exc:  # also the guard's: a replay cannot be ruled out
            return error_response(503, "redis", str(exc))
        except AuthenticationError as exc:
            metrics.rejected.labels("auth").inc()
            refusals.warn("gossip", sender, exc)
            return error_response(401, "auth", str(exc))
        except ProtocolError as exc:
            metrics.rejected.labels("decode").inc()
            refusals.warn("gossip", sender, exc)
            return error_response(400, "decode", str(exc))
        payload = wire.encode(reply)
        headers = agent.signer.headers(payload, sender, seq=int(request.headers[SEQ]), response=True)
        headers["Content-Type"] = CONTENT_TYPE
        return web.Response(body=payload, headers=headers)

    app.router.add_post(GOSSIP_PATH, gossip)

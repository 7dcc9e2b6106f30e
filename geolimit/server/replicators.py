"""The agent's replicators, built from its configuration: the gossip engine and the escrow replicator.

:class:`~geolimit.server.agent.Agent` builds them once its limiter is connected
(``listen()``); each gets a store of its own over the limiter's Redis and a signed
HTTP transport to every peer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.clock import Clock, micros_source
from geolimit.replication.auth import Signer, Verifier
from geolimit.replication.escrow import EscrowReplicator
from geolimit.replication.escrow_http import EscrowHttpTransport
from geolimit.replication.escrow_io import EscrowStore
from geolimit.replication.gossip import EngineSettings, GossipEngine
from geolimit.replication.peers import heartbeat_for
from geolimit.replication.redis_io import ReplicationStore
from geolimit.replication.transport import HttpTransport, Transport
from geolimit.server.config import AgentConfig

__all__ = ["escrow_replicator", "gossip_engine", "gossip_transport"]


def gossip_transport(cfg: AgentConfig, signer: Signer, verifier: Verifier) -> HttpTransport:
    """Gossip's signed HTTP transport to every peer of ``cfg``."""
    ssl_ctx = cfg.tls.client_context() if cfg.tls else None
    return HttpTransport(
        {p.name: p.url for p in cfg.peers}, signer, verifier, cfg.timeout, ssl_ctx,
        max_response_bytes=4 * cfg.max_message_bytes,
    )


def gossip_engine(
    cfg: AgentConfig, limiter: AsyncLimiter, transport: Transport, *, owned: Sequence[int], anti_entropy: bool,
    decision_clock: Clock | None, clock: Callable[[], float], worker: int = 0,
) -> GossipEngine:
    """The gossip engine of the shards in ``owned`` (``anti_entropy``: it also starts the exchanges),
    worker ``worker`` of ``cfg.workers``."""
    store = ReplicationStore(
        limiter.store, limiter.layout, cfg.region, limiter.rules,
        nonce=secrets.token_hex(3).encode(),
        now_us=micros_source(decision_clock) or (lambda: None),
        peers=[p.name for p in cfg.peers], owned=owned,
    )
    settings = EngineSettings(
        interval=cfg.interval, anti_entropy_interval=cfg.anti_entropy_interval,
        max_backoff=cfg.max_backoff or 2 * cfg.interval,
        heartbeat=heartbeat_for(cfg.interval, cfg.rules), lease_ttl=max(15.0, 20 * cfg.interval),
        max_cells_per_message=max(1000, min(10_000, cfg.max_message_bytes // 40)), send_timeout=cfg.timeout,
        anti_entropy=anti_entropy, several_workers=cfg.workers > 1,
        worker=worker, workers=cfg.workers,
    )
    return GossipEngine(cfg.region, [p.name for p in cfg.peers], store, transport, settings, clock)


def escrow_replicator(
    cfg: AgentConfig, limiter: AsyncLimiter, signer: Signer, verifier: Verifier, *, owned: Sequence[int],
    decision_clock: Clock | None, clock: Callable[[], float],
) -> EscrowReplicator:
    """The escrow rules' rebalancing and replication, over its own signed HTTP transport."""
    transport = EscrowHttpTransport(
        {p.name: p.url for p in cfg.peers}, signer, verifier, cfg.timeout,
        cfg.tls.client_context() if cfg.tls else None, max_response_bytes=4 * cfg.max_message_bytes,
    )
    return EscrowReplicator(
        cfg.region, [p.name for p in cfg.peers], EscrowStore(limiter.store, limiter.layout, cfg.region,
                                                             secrets.token_hex(3).encode(),
                                                             clock_tolerance=cfg.auth_window),
        limiter.rules, transport, owned=owned, interval=cfg.interval, timeout=cfg.timeout,
        pull_interval=cfg.anti_entropy_interval, now_us=micros_source(decision_clock) or (lambda: None),
        clock=clock,
    )

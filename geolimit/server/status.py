"""The agent's ``/v1/status`` document: the region, its incarnations, readiness and every peer link."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geolimit.server.agent import Agent

__all__ = ["agent_status"]


def agent_status(agent: Agent, now: float) -> dict[str, Any]:
    """``/v1/status`` of ``agent`` at clock time ``now``."""
    engine = agent.engine
    peers: dict[str, Any] = {}
    incarnations: dict[str, int] = {}
    warnings: list[str] = []  # what an operator must fix; readiness ignores peers (a region decides alone)
    if engine is not None:
        for slot in engine.own_slots.values():
            inc = slot.rpartition("/")[2]
            incarnations[inc] = incarnations.get(inc, 0) + 1
        for peer in engine.peers.values():
            peers[peer.name] = {
                "last_contact": peer.last_ok,
                "last_contact_age": None if peer.last_ok is None else round(now - peer.last_ok, 3),
                # The oldest change it has not acknowledged (queued or in flight); while its
                # exchanges fail, at least the time since it acknowledged any (PeerState.lag).
                "lag": round(peer.lag(now), 3),
                "outbox": peer.queued,
                "in_flight": len(peer.flying),
                "errors": peer.errors,
                "consecutive_failures": peer.failures,
                "last_error": peer.last_error,
                "last_error_age": None if peer.last_error_at is None else round(now - peer.last_error_at, 3),
                "cells_sent": peer.cells_sent,
                "cells_received": peer.cells_received,
                "anti_entropy_ok": peer.ae_ok,
                "anti_entropy": engine.repair.status(peer.name),
                "refused_cells": peer.refused,
                "rtt": round(peer.rtt, 4),
                "clock_offset": round(peer.skew, 3),
                # Signed messages refused because their time was outside the auth window.
                "clock_refusals": peer.clock_refusals,
                "refused_clock_offset": None if peer.refused_offset is None else round(peer.refused_offset, 3),
                "refused_clock_offset_age": None if peer.refused_offset_at is None
                else round(now - peer.refused_offset_at, 3),
                # Exchanges it refused (401 "auth") or answered unverifiably: another secret_file.
                "auth_refusals": peer.auth_refusals,
                "auth_refused": peer.auth_refused,
                "auth_refused_reason": peer.auth_refused_reason,
                "auth_refused_age": None if peer.auth_refused_at is None else round(now - peer.auth_refused_at, 3),
            }
            if peer.auth_refused and "unknown region" in (peer.auth_refused_reason or ""):
                warnings.append(f"peer {peer.name} does not know this region's name ({peer.auth_refusals} so far): "
                                f"its [peers] must name this region {agent.config.region!r} exactly; nothing "
                                f"replicates with {peer.name} until it does")
            elif peer.auth_refused:
                warnings.append(f"peer {peer.name} refuses this region's signature ({peer.auth_refusals} "
                                f"so far): every region's secret_file must hold the same secret, and its "
                                f"[peers] must name this region {agent.config.region!r}; nothing "
                                f"replicates with {peer.name} until they do")
    ready, waiting = agent.readiness()
    newest = max(incarnations, default=None)
    return {
        "region": agent.config.region,
        "incarnation": newest,
        "incarnations": incarnations,
        "ready": ready,
        "waiting_for": waiting,
        "warnings": warnings,
        "peers": peers,
        # Seconds added to this region's clock for buckets: the regions agree on the mean clock.
        "clock_correction": None if engine is None else round(engine.clock_correction, 4),
        # Shards whose Redis (a Cluster node) failed in the last round: gossip goes on for the others.
        "shards_unreachable": [] if engine is None else sorted(engine.failed_shards),
        "failures": agent.background_failures(),
        # Checks being decided, the bound (region.max_checks_in_progress), requests answered 503 over it.
        "checks": {"in_progress": agent.checks.in_progress, "max": agent.checks.bound, "shed": agent.checks.shed},
        # Several workers: the figures above are those of the worker that answered (its shards'
        # outboxes); region_peers has the region's, over every worker (at most a second old).
        "worker": {"index": agent.worker_index, "workers": agent.config.workers, "shards": len(agent.owned),
                   "pid": os.getpid(), "region_peers": agent.metrics.region_peers()},
        "rules": {r.name: r.describe() for r in agent.config.rules},
        # [[rule]] tables with several rates: the decision API takes the table's name for all of them.
        "rule_groups": {name: list(members) for name, members in agent.config.rule_groups.items()},
        "escrow": None if agent.escrow is None or not agent.escrow.rules else agent.escrow.status(),
    }

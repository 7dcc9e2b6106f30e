"""The gossip engine's side of anti-entropy: when to run an exchange, and its I/O.

:class:`~geolimit.replication.antientropy.AntiEntropy` does the exchange itself
(bounded digest passes in Redis, a Merkle descent, paged repair). This driver
starts one per peer when the peer asks for it (a wipe, a link that was down, a
run that had more differences than it could repair) or every
``anti_entropy_interval``, carries its steps in ``ae`` gossip messages, merges
what it brings in repair mode, and keeps its outcome for ``/v1/status``.

A failed or slow exchange is not a dead peer: deltas keep flowing, and the run
is retried with its own backoff.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from geolimit.errors import ProtocolError, StorageError
from geolimit.replication.ae_requests import AntiEntropyRequests
from geolimit.replication.antientropy import AntiEntropy, AntiEntropyResult
from geolimit.replication.antientropy.common import Admit
from geolimit.replication.peers import PeerState
from geolimit.replication.transport import TransportError
from geolimit.replication.wire import Blob

if TYPE_CHECKING:
    from geolimit.replication.gossip import GossipEngine

__all__ = ["SPACING", "AntiEntropyDriver", "periodic_wait"]

log = logging.getLogger("geolimit.gossip")

#: Longest wait before a failed exchange is tried again (seconds).
MAX_RETRY = 60.0
#: A periodic exchange waits at least this many times as long as the last one took.
SPACING = 10.0


def periodic_wait(interval: float, last_seconds: float) -> float:
    """Seconds until the next periodic exchange with a peer.

    ``anti_entropy_interval`` is the least wait. With millions of keys one
    exchange takes seconds of both Redis servers' time even when nothing
    differs, so the wait grows to :data:`SPACING` times the last exchange's
    duration: periodic repair then costs at most about a tenth of the time.
    (Exchanges that something asked for, after an outage or a wipe, start at once.)
    """
    return max(interval, SPACING * last_seconds)


class AntiEntropyDriver:
    """Runs anti-entropy exchanges for a :class:`GossipEngine` and serves its peers'."""

    def __init__(self, engine: GossipEngine) -> None:
        self.engine = engine
        store, settings = engine.store, engine.settings
        self.ae = AntiEntropy(
            engine.region, store.store, store.layout, store.rules, self._send, self._merge, engine.region_clock,
            max_keys=settings.ae_max_keys, duty=settings.ae_duty,
        )
        self.last: dict[str, AntiEntropyResult] = {}
        self.requests = AntiEntropyRequests(store.store, store.layout)
        #: Peers whose running exchange repairs a wipe of our Redis (see _merge).
        self._relay_all: set[str] = set()

    async def share_requests(self) -> None:
        """With several workers per region (``several_workers``): the initiator takes the
        exchanges the other workers asked for; any other worker hands over what it needs.

        A worker that is not the initiator never starts an exchange, so what it learns (a
        wipe of shards it owns, a peer's report of a link down, a refused batch, a peer
        back after failures) would otherwise wait for the next periodic exchange.
        """
        engine = self.engine
        if not engine.settings.several_workers:
            return
        peers = engine.peers
        if engine.settings.anti_entropy:
            try:
                taken = await self.requests.take(peers)
            except StorageError as exc:
                engine.note_sharing("requests", str(exc))
                return
            engine.note_sharing("requests", None)
            for name, request in taken.items():
                peer = peers[name]
                # An exchange that was asked for (not a periodic one, which skips the latest
                # buckets) and started after the request covers its cause: not again.
                if not request.after_wipe and peer.ae_asked_at is not None and peer.ae_asked_at >= request.posted:
                    continue
                peer.ae_needed = True
                peer.ae_after_wipe = peer.ae_after_wipe or request.after_wipe
            return
        # Cleared before the call: a flag that a send sets meanwhile is handed over next round.
        wanted = {p.name: p.ae_after_wipe for p in peers.values() if p.ae_needed}
        for name in wanted:
            peers[name].ae_needed = peers[name].ae_after_wipe = False
        try:
            await self.requests.post(wanted, engine.clock())
        except BaseException as exc:
            for name, after_wipe in wanted.items():
                peers[name].ae_needed = True
                peers[name].ae_after_wipe = peers[name].ae_after_wipe or after_wipe
            if not isinstance(exc, StorageError):
                raise
            engine.note_sharing("requests", str(exc))
            return
        if wanted:
            engine.note_sharing("requests", None)
            log.info("region %s: asked the region's first worker for anti-entropy with %s",
                     engine.region, ", ".join(sorted(wanted)))

    def start_due(self, now: float) -> None:
        """Start an exchange with every reachable peer that needs or is due one."""
        if not self.engine.settings.anti_entropy:
            return
        for peer in self.engine.peers.values():
            if peer.failures and not peer.ae_running:
                # Unreachable: its first exchange would fail too, so readiness does not wait
                # for it (which depended on the first send failing only after the exchange
                # had started); ae_needed stays, and the exchange runs once the peer answers.
                peer.ae_concluded = True
            ready = now >= peer.next_attempt and now >= peer.ae_retry_at and not peer.failures
            if not peer.ae_running and ready and (peer.ae_needed or now >= peer.ae_due):
                peer.ae_running = True
                self.engine.spawn(self._run(peer))

    async def _send(self, peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        engine = self.engine
        msg = engine.message("ae", peer)
        msg.ae = payload
        sent = engine.clock()
        reply = await engine.transport.send(peer, msg)
        state = engine.peers[peer]
        now = engine.clock()  # the peer's counts are not newer for it (not last_heard: see peer_ages)
        engine.note_clock_sample(state, reply.now_us, sent, now)
        engine.note_reach(state, reply, now)
        return reply.ae

    async def _merge(self, peer: str, blobs: list[Blob], admit: Admit | None) -> None:
        # Repair mode: cells claiming more in our own slot than we hold (a failover
        # or a restore lost our latest writes) are skipped and counted, so the rest
        # of the repair goes through.
        engine = self.engine
        state = engine.peers[peer]
        # After a wipe our outboxes are gone with the data: what our old incarnation had
        # sent to one peer and not yet to another comes back only in these repairs, so
        # they go on to every other peer (max-merges: a duplicate costs nothing else).
        relay = sorted(p for p in engine.peers if p != peer) if peer in self._relay_all else engine.relays(state)
        merged = await engine.store.merge_blobs(blobs, peer, relay, admit=admit, repair=True)
        engine.count(state, merged)

    async def _run(self, peer: PeerState) -> None:
        engine, stats = self.engine, self.engine.stats
        # Clear the request when the run *starts*: a wipe detected while this run is
        # in flight asks again, and this run (which read the data before the wipe)
        # must not swallow that request when it ends.
        # A periodic exchange settles (skips the buckets that deltas may still be filling);
        # one that something asked for (start-up, a wipe, a link back up) compares all.
        periodic = not peer.ae_needed
        if not periodic:
            peer.ae_asked_at = engine.clock()
        peer.ae_needed = False
        after_wipe, peer.ae_after_wipe = peer.ae_after_wipe, False
        if after_wipe:
            self._relay_all.add(peer.name)
        result: AntiEntropyResult | None = None
        stats["ae_runs"] += 1
        try:
            result = await self.ae.run(peer.name, engine.settings.ae_settle if periodic else 0.0)
        except (TransportError, ProtocolError, StorageError) as exc:
            engine.note_auth_failure(peer, exc)
            stats["ae_failed"] += 1
            peer.ae_failures += 1
            peer.ae_last_error = f"{type(exc).__name__}: {exc}"[:300]
            delay = min(MAX_RETRY, engine.settings.interval * 2 ** min(peer.ae_failures, 16))
            peer.ae_retry_at = engine.clock() + delay * engine.rng.uniform(0.5, 1.0)
            log.warning("region %s: anti-entropy with %s failed (%d in a row; retried in %.1f s): %s",
                        engine.region, peer.name, peer.ae_failures, delay, exc)
        finally:
            peer.ae_running = False
            peer.ae_concluded = True
            self._relay_all.discard(peer.name)
            if result is None:
                peer.ae_needed = True
                peer.ae_after_wipe = peer.ae_after_wipe or after_wipe
        if result is None:
            return
        self.last[peer.name] = result
        stats["ae_cells"] += result.cells_received + result.cells_sent
        stats["ae_keys_repaired"] += result.keys_differing
        peer.ae_ok += 1
        peer.ae_failures = 0
        if not periodic and not result.truncated and peer.ae_asked_at is not None:
            # An exchange that compared every bucket brought the peer's counts as of its
            # start: they are that fresh here even before its first delta arrives (a region
            # that just started, or a peer whose deltas cannot reach us).
            peer.last_heard = max(peer.last_heard or 0.0, peer.ae_asked_at)
        peer.ae_last_error = None
        wait = periodic_wait(engine.settings.anti_entropy_interval, result.seconds)
        peer.ae_due = engine.clock() + wait * engine.rng.uniform(0.8, 1.2)
        if result.truncated:  # more differences than one run repairs: go on at once, the same way
            if periodic:
                peer.ae_due = engine.clock()
            else:
                peer.ae_needed = True

    def status(self, name: str) -> dict[str, Any]:
        """The last exchange with peer ``name``, for ``/v1/status``."""
        peer = self.engine.peers[name]
        last = self.last.get(name)
        out: dict[str, Any] = {"running": peer.ae_running, "ok": peer.ae_ok, "failures": peer.ae_failures,
                               "last_error": peer.ae_last_error}
        if last is not None:
            out.update(seconds=round(last.seconds, 3), keys_scanned=last.keys_scanned,
                       keys_differing=last.keys_differing, cells_received=last.cells_received,
                       cells_sent=last.cells_sent, truncated=last.truncated, settle=last.settle,
                       keys_skipped=last.keys_skipped)
        return out

"""The receiving side of the gossip engine: merge, relay and what peers report.

:class:`Receiver` is a mixin of :class:`~geolimit.replication.gossip.GossipEngine`:
it checks a peer's message against this region's view, merges its cells
(``merge.lua``, through :meth:`ReplicationStore.merge_blobs`), decides which peers
they are relayed to, and records what the sender says about its own links.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING

from geolimit.errors import AuthenticationError, ClockSkewError, ProtocolError, TransportError
from geolimit.replication import wire
from geolimit.replication.peers import EngineSettings, PeerState
from geolimit.replication.redis_io import MergeResult, ReplicationStore

if TYPE_CHECKING:
    from geolimit.replication.gossip_repair import AntiEntropyDriver

__all__ = ["Receiver"]

log = logging.getLogger("geolimit.gossip")

#: Seconds between two warnings that one peer refuses this region's signature.
AUTH_WARN_EVERY = 60.0


class Receiver:
    """Handles authenticated, decoded messages from peers (mixed into the engine)."""

    region: str
    store: ReplicationStore
    settings: EngineSettings
    peers: dict[str, PeerState]
    stats: dict[str, float]
    clock: Callable[[], float]
    repair: AntiEntropyDriver

    def message(self, kind: str, dest: str, blobs: list[wire.Blob] | None = None) -> wire.Message:
        raise NotImplementedError

    def _down_in_report(self, source: str, failing: Collection[str], reach: Mapping[str, float],
                        since: float = 0.0) -> frozenset[str]:
        """The peers that a report of ``source`` (``since`` seconds old) says it cannot reach:
        its last send failed, or no acknowledgement for two heartbeats plus two
        intervals, or it never reached them."""
        stale = self.report_stale()
        return frozenset(p for p in self.peers
                         if p != source and (p in failing or reach.get(p, math.inf) + since > stale))

    def report_stale(self) -> float:
        """Seconds without an acknowledgement after which a peer's link counts as down
        (two heartbeats plus two intervals)."""
        return 2 * self.settings.heartbeat + 2 * self.settings.interval

    def report_persist(self) -> float:
        """Seconds a link must stay reported down before it asks for anti-entropy with its
        target (:meth:`lapse_down_reports`): five rounds, and at least two retries of a
        failed send (``max_backoff``), 0.5 s by default. A send that failed once and went
        through on its retry is gone from the next report; a partial partition between two
        other regions still converges through this one within a few rounds more
        (tests/sim/test_scenarios.py)."""
        return max(5 * self.settings.interval, 2 * self.settings.max_backoff)

    def relays(self, source: PeerState, msg: wire.Message | None = None) -> list[str]:
        """The peers that cells from ``source`` are relayed to: those it cannot reach.

        ``source`` delivers to every peer itself (its outboxes are durable), so in
        a healthy mesh a relay is only a duplicate: cells are relayed to a peer
        only while ``source`` reports that link down in ``msg`` (or, without one,
        in its last report, aged since). Cells merged here before such a report
        arrived are repaired by the anti-entropy that the report starts with that
        peer (:meth:`note_reach`).
        """
        if msg is not None:
            down = self._down_in_report(source.name, msg.failing, msg.reach)
        else:
            down = self._down_in_report(source.name, source.failing, source.reach, self.clock() - source.reach_at)
        return sorted(down)

    def note_reach(self, peer: PeerState, msg: wire.Message, now: float) -> None:
        """Record what ``peer`` says of its links, and when a link first showed down.

        A link that ``peer``'s reports show going down may have swallowed cells we
        merged (without relaying them) while its reports still showed it up:
        relay covers what comes next, and anti-entropy with that target repairs
        the rest once the link has been reported down for :meth:`report_persist`
        (0.5 s by default; :meth:`lapse_down_reports`). A shorter failure (one send
        that failed, then the next one went through) lost nothing: ``peer``'s own
        outbox to the target delivered those cells. Asking for an exchange of every
        bucket at the first report, as this did before, made every such blip
        between two other regions cost this one a full exchange (under load, its
        cap of keys whose deltas were still travelling). Reports are compared as
        sent, never aged by our clock, so a link that went down between two
        reports always counts.
        """
        down = self._down_in_report(peer.name, msg.failing, msg.reach)
        if peer.reach_at:  # a first report is no news (start-up runs anti-entropy anyway)
            for target in down - peer.reported_down:
                peer.down_reported.setdefault(target, now)
        for target in [t for t in peer.down_reported if t not in down]:
            del peer.down_reported[target]  # back up: its outbox delivered
        peer.reported_down = down
        peer.reach = dict(msg.reach)
        peer.reach_at = now
        peer.failing = frozenset(msg.failing)
        if msg.now_us and not peer.clock_samples:  # until our own exchanges measure it better
            sample = msg.now_us / 1_000_000 - (now - peer.rtt / 2)
            peer.skew = 0.8 * peer.skew + 0.2 * sample if peer.skew_known else sample
            peer.skew_known = True

    def lapse_down_reports(self, now: float) -> None:
        """Ask for anti-entropy with each peer whose link from another peer has been
        reported down for :meth:`report_persist` or more, whether that peer still reports
        it or has gone silent (a region that died with cells in its outbox)."""
        persist = self.report_persist()
        for peer in self.peers.values():
            for target, since in list(peer.down_reported.items()):
                if now - since >= persist:
                    del peer.down_reported[target]
                    if target in self.peers:
                        self.peers[target].ae_needed = True

    def note_clock_sample(self, peer: PeerState, peer_now_us: int, sent: float, received: float) -> None:
        """One exchange with ``peer``: we sent at ``sent``, its answer says its clock read
        ``peer_now_us`` and reached us at ``received`` (our clock, seconds).

        The offset is the answer's time minus the exchange's midpoint (NTP's estimate,
        off by at most half the round trip); of the last exchanges, the one with the
        shortest round trip is the least delayed by queues on either side, so it gives
        the offset. An average of every message's offset swung by ±0.18 s on a loaded
        host: queueing only ever makes a message look later.
        """
        if not peer_now_us or received < sent:
            return
        peer.clock_samples.append((received - sent, peer_now_us / 1_000_000 - (sent + received) / 2))
        peer.skew = min(peer.clock_samples)[1]
        peer.skew_known = True

    def note_clock_refused(self, peer_name: str, offset: float) -> None:
        """A signed message from ``peer_name`` was refused: its time is ``offset`` s off ours.

        Counted and kept for ``/v1/status`` and the metrics; logged on the first
        refusal and then every 100th (a skewed peer sends one every round).
        """
        peer = self.peers.get(peer_name)
        if peer is None:
            return
        peer.clock_refusals += 1
        peer.refused_offset = offset
        peer.refused_offset_at = self.clock()
        if peer.clock_refusals == 1 or peer.clock_refusals % 100 == 0:
            log.error(
                "region %s: refused gossip from %s (%d so far): its clock is %+.1f s off ours, outside the auth "
                "window; replication with it has stopped until the clocks are fixed (NTP)",
                self.region, peer_name, peer.clock_refusals, offset,
            )

    def note_auth_failure(self, peer: PeerState, exc: BaseException) -> None:
        """An exchange with ``peer`` failed: if ``peer`` does not accept this region's
        signature (401 ``auth``: another secret, most likely) or its answer fails ours,
        count it for ``/v1/status`` and the metrics, and warn, once every
        :data:`AUTH_WARN_EVERY` seconds per peer, naming the ``secret_file`` setting.
        Readiness does not change: a region whose peers are out of reach still decides."""
        if isinstance(exc, TransportError) and exc.status == 401 and exc.reason == "auth":
            why = str(exc)  # "<peer> answered HTTP 401: bad signature ... (auth)"
        elif isinstance(exc, AuthenticationError) and not isinstance(exc, ClockSkewError):
            why = f"{peer.name}'s answer fails this region's signature check: {exc}"
        else:
            return
        now = self.clock()
        peer.auth_refusals += 1
        peer.auth_refused = True
        peer.auth_refused_reason = why[:400]
        peer.auth_refused_at = now
        if peer.auth_warned_at is not None and now - peer.auth_warned_at < AUTH_WARN_EVERY:
            peer.auth_held_back += 1
            return
        more = f", {peer.auth_held_back} since the last warning" if peer.auth_held_back else ""
        peer.auth_warned_at, peer.auth_held_back = now, 0
        if "unknown region" in why:  # it has no peer of this name: the names, not the secret
            log.warning(
                "region %s: peer %s does not know this region's name (%d so far%s): %s. Its [peers] must name "
                "this region %r exactly, and this region's must name it as it names itself; nothing replicates "
                "with %s until they do", self.region, peer.name, peer.auth_refusals, more, why, self.region, peer.name,
            )
            return
        log.warning(
            "region %s: peer %s refuses this region's signature (%d so far%s): %s. Every region's [region] "
            "secret_file must hold the same secret; nothing replicates with %s until it does (restart the agent "
            "whose file changed)", self.region, peer.name, peer.auth_refusals, more, why, peer.name,
        )

    # -- receiving ------------------------------------------------------------

    async def receive(self, msg: wire.Message, admit: Callable[[], Awaitable[object]] | None = None) -> wire.Message:
        """Handle an authenticated, decoded message from a peer and build the response.

        ``admit`` (the replay guard) runs once the message passed every check and
        before anything is written, so a refused message leaves Redis untouched.
        """
        now = self.clock()
        peer = self.peers.get(msg.sender)
        if peer is None:
            raise ProtocolError(f"message from unknown peer {msg.sender!r}")
        if msg.dest != self.region:
            raise ProtocolError(f"message addressed to {msg.dest!r}, this is {self.region!r}")
        if msg.shards != self.store.layout.shards:
            raise ProtocolError(
                f"{msg.sender} uses {msg.shards} shards and this region {self.store.layout.shards}: "
                f"every region must use the same [region] shards"
            )
        if msg.kind not in ("delta", "ae"):
            raise ProtocolError(f"unexpected message kind {msg.kind!r}")
        reply = self.message("ack", peer.name)
        if msg.kind == "delta":
            await self._merge(peer, msg, self.update_gap(peer, msg), admit)
            if not msg.partial:  # (partial: a worker of the peer is down, its shards' changes wait)
                peer.last_heard = now  # its counts as of its last drain (GossipEngine.peer_ages)
        else:
            reply.ae = await self.repair.ae.handle(peer.name, msg.ae, admit)
        self.note_reach(peer, msg, now)
        return reply

    def update_gap(self, peer: PeerState, msg: wire.Message) -> int:
        """The time (µs) between ``peer``'s delta ``msg`` and its previous one, for prediction.

        Measured on the sender's clock (``now_us``), so latency and skew do not
        enter. At least one gossip interval: the peer drains its changes once a
        round, so a message that follows another within one (the rest of a backlog,
        or one overtaken in flight) still carries a round's worth of them.
        """
        floor = int(self.settings.interval * 1_000_000)
        previous = peer.update_us
        if msg.now_us > previous:
            peer.update_us = msg.now_us
        if not previous or msg.now_us <= previous:
            return floor
        return max(floor, msg.now_us - previous)

    async def _merge(
        self, peer: PeerState, msg: wire.Message, gap_us: int,
        admit: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        if not msg.blobs:
            if admit is not None:
                await admit()
            return
        rules = self.store.rules
        accepted = [n for n, structure in msg.rules.items() if n in rules and rules[n].structure == structure]
        mismatched = sorted(n for n, s in msg.rules.items() if n in rules and rules[n].structure != s)
        if mismatched:
            log.warning("region %s: %s sent rules %s with another window/resolution; ignored",
                        self.region, msg.sender, mismatched)
        relay = self.relays(peer, msg)
        try:
            merged = await self.store.merge_blobs(msg.blobs, peer.name, relay, accepted, admit, gap_us=gap_us)
        except ProtocolError:
            self.stats["refused"] += 1
            raise
        self.count(peer, merged)

    def count(self, peer: PeerState, merged: MergeResult) -> None:
        """Add a merge's outcome to the stats (and warn about own-slot claims)."""
        peer.cells_received += merged.cells
        self.stats["merged"] += merged.cells
        self.stats["increased"] += merged.increased
        self.stats["dropped_old"] += merged.dropped_old
        self.stats["dropped_future"] += merged.dropped_future
        self.stats["parked"] += merged.parked
        self.stats["unknown_rule"] += merged.unknown_rule
        self.stats["relayed"] += merged.relayed
        own_ahead = merged.own_ahead
        if own_ahead:
            self.stats["own_ahead"] += own_ahead
            log.warning("region %s: %s holds more hits in this region's own slot than this Redis (%d cells "
                        "skipped): did Redis fail over or restore a snapshot and lose recent writes?",
                        self.region, peer.name, own_ahead)

"""The sending side of the gossip engine: outbox batches to peers, and what their answers say.

:class:`Sender` is a mixin of :class:`~geolimit.replication.gossip.GossipEngine`:
it packs a peer's outbox into an in-flight slot (``pack.lua``, through
:meth:`ReplicationStore.pack`), sends it, and acknowledges or returns the batch
(``settle``) by the answer; failures back off, refusals start anti-entropy.
"""

from __future__ import annotations

import logging
import random

from geolimit.errors import ClockSkewError, ProtocolError
from geolimit.replication import wire
from geolimit.replication.gossip_receive import Receiver
from geolimit.replication.peers import PeerState, message_caps
from geolimit.replication.redis_io import Packed
from geolimit.replication.transport import PeerRefused, Transport, TransportError

__all__ = ["Sender"]

log = logging.getLogger("geolimit.gossip")


class Sender(Receiver):
    """Delivers outbox batches to peers (the engine is a Sender, which is a Receiver)."""

    transport: Transport
    rng: random.Random

    async def _collect(self, peer: PeerState, slot: int, limit: int) -> Packed:
        """Pack up to ``limit`` cells of ``peer``'s outbox into in-flight ``slot``.

        Shards are taken in turn from the peer's cursor, 8 per batch of script
        calls. Each gets room for its whole outbox while the limit allows (a
        whole outbox moves into flight in O(1), see pack.lua), and the last one
        what is left, so the caps of a message never add up to more than ``limit``.
        """
        total = Packed()
        owned = self.store.owned
        shards = len(owned)
        for _ in range(4):  # a shard gives at most 4 batches to one message
            order = [owned[(peer.cursor + i) % shards] for i in range(shards)]
            todo = [s for s in order if peer.pending.get(s)]
            if not todo:
                break
            for start in range(0, len(todo), 8):
                room = limit - total.cells
                batch, caps = message_caps(todo[start : start + 8], peer.pending, room)
                if not batch:
                    break
                got = await self.store.pack(peer.name, slot, batch, caps)
                total.blobs += got.blobs
                for shard, keys in got.shards.items():
                    total.shards[shard] = total.shards.get(shard, 0) + keys
                total.keys += got.keys
                # Counted in flight as they leave the outbox: peer.queued never dips mid-pack.
                peer.flight_keys[slot] = total.keys
                total.cells += got.cells
                total.unknown += got.unknown
                total.bad += got.bad
                for shard, left in got.left.items():
                    if left:
                        peer.pending[shard] = left
                    else:
                        peer.pending.pop(shard, None)
                if total.cells >= limit:
                    break
            if total.cells >= limit:
                break
        peer.cursor = (peer.cursor + 1) % shards
        if total.keys and not peer.pending:  # the whole outbox is in flight now, its age with it
            peer.oldest_us = None
        self.stats["unknown_rule"] += total.unknown
        self.stats["bad_values"] += total.bad
        return total

    async def _send(self, peer: PeerState, slot: int) -> None:
        """Deliver outbox batches through in-flight ``slot`` until the outbox is empty."""
        try:
            while True:
                # A failing peer gets small messages until one succeeds, then the rest;
                # a slow one gets smaller messages (see PeerState.resize).
                limit = self.settings.probe_cells if peer.failures else peer.message_limit(self.settings)
                async with peer.packing:
                    limit = peer.ramp_limit(limit)
                    try:
                        packed = await self._collect(peer, slot, limit)
                    except BaseException:
                        # Some shards' keys may already be in flight in this slot (a later
                        # shard's call failed): a later round returns them to the outbox.
                        peer.unsettled.add(slot)
                        raise
                peer.last_attempt = sent_at = self.clock()
                if packed.keys:  # unacknowledged from now on: the peer's lag counts them (PeerState.lag)
                    peer.flight_since[slot] = packed.queued_us if packed.queued_us is not None \
                        else int(sent_at * 1_000_000)
                try:
                    reply = await self.transport.send(peer.name, self.message("delta", peer.name, packed.blobs))
                    self.note_clock_sample(peer, reply.now_us, sent_at, self.clock())
                except PeerRefused as exc:
                    # Sending it again would be refused again: drop the batch rather than
                    # block the outbox behind it; anti-entropy repairs what it carried.
                    await self._conclude(peer, slot, packed, delivered=True)
                    self._refused(peer, packed, exc)
                    return
                except (TransportError, ProtocolError) as exc:
                    await self._conclude(peer, slot, packed, delivered=False)
                    peer.resize(self.settings, packed.cells, None)
                    self._failed(peer, exc)
                    return
                await self._conclude(peer, slot, packed, delivered=True)
                took = max(0.0, self.clock() - sent_at)  # (a clock stepped back meanwhile)
                peer.resize(self.settings, packed.cells, took)
                peer.rtt = took if peer.rtt == 0.0 else 0.8 * peer.rtt + 0.2 * took
                peer.cells_sent += packed.cells
                self._succeeded(peer, reply)
                if packed.cells < limit or not peer.unsent:
                    return
        finally:
            peer.flying.discard(slot)
            peer.flight_keys.pop(slot, None)
            self._unacknowledged(peer, peer.flight_since.pop(slot, None))  # cancelled mid-flight

    async def _conclude(self, peer: PeerState, slot: int, packed: Packed, delivered: bool) -> None:
        since = peer.flight_since.pop(slot, None)
        if not packed.shards:
            return
        settled = False
        try:
            await self.store.settle(peer.name, slot, sorted(packed.shards), delivered)
            settled = True
        except BaseException:
            peer.unsettled.add(slot)  # returned to the outbox by a later round (or a restart)
            raise
        finally:
            if not delivered:  # back in the outbox (or soon): count them as queued again
                for shard, keys in packed.shards.items():
                    peer.pending[shard] = peer.pending.get(shard, 0) + keys
            if not (delivered and settled):  # back in the outbox with their age (settle.lua)
                self._unacknowledged(peer, since)

    @staticmethod
    def _unacknowledged(peer: PeerState, since: int | None) -> None:
        """Changes queued since ``since`` (µs) are in the outbox again, not yet acknowledged."""
        if since is not None:
            peer.oldest_us = since if peer.oldest_us is None else min(peer.oldest_us, since)

    def _succeeded(self, peer: PeerState, reply: wire.Message) -> None:
        now = self.clock()
        if peer.auth_refused:
            log.info("region %s: peer %s accepts this region's signature again", self.region, peer.name)
            peer.auth_refused = False
            peer.auth_warned_at = None
        down_for = None if peer.failing_since is None else now - peer.failing_since
        peer.failing_since = None
        if peer.failures:
            reached = peer.last_ok is not None or peer.ae_ok > 0
            again = " again" if reached else ""
            log.info("region %s: peer %s reachable%s after %d failures", self.region, peer.name, again, peer.failures)
            # Exchanges failed while the link was down: that says nothing of the next
            # one, which should start at once. An outage of ae_settle or more asks for an
            # exchange of every bucket, to repair what it missed. A shorter one (a send
            # timed out under load, a refused connection) lost nothing: the outbox kept its
            # changes, and the next periodic exchange compares their buckets once settled.
            # Nor does a peer never reached before (it was still starting): the start-up
            # exchange compares every bucket. Asking on every first success made each agent
            # of bench/soak.py run one more unsettled exchange under full load, listing
            # its cap of "differing" keys (their deltas were travelling): RSS +26%.
            if reached and down_for is not None and down_for >= self.settings.ae_settle:
                peer.ae_needed = True
            peer.ae_failures = 0
            peer.ae_retry_at = 0.0
        peer.failures = 0
        # Not last_heard: an acknowledgement carries none of the peer's counts, and a peer whose
        # own deltas cannot reach us (a wrong URL for us in its config, its egress blocked)
        # acknowledges ours all the same (GossipEngine.peer_ages).
        peer.last_ok = now
        peer.next_attempt = 0.0
        self.note_reach(peer, reply, now)

    def _refused(self, peer: PeerState, packed: Packed, exc: PeerRefused) -> None:
        peer.errors += 1
        peer.refused += packed.cells
        peer.last_error = str(exc)[:300]
        peer.last_error_at = self.clock()
        peer.ae_needed = True
        self.stats["refused_by_peers"] += packed.cells
        log.error("region %s: %s refused a batch of %d cells (dropped; anti-entropy repairs it): %s",
                  self.region, peer.name, packed.cells, exc)

    def _failed(self, peer: PeerState, exc: BaseException) -> None:
        if isinstance(exc, ClockSkewError):  # its signed answer's time is outside the auth window
            self.note_clock_refused(peer.name, exc.offset)
        self.note_auth_failure(peer, exc)
        if not peer.failures:  # it has acknowledged nothing since (PeerState.lag)
            peer.failing_since = peer.last_ok if peer.last_ok is not None else peer.last_attempt
        peer.failures += 1
        peer.errors += 1
        peer.last_error = str(exc)[:300]
        peer.last_error_at = self.clock()
        backoff = min(self.settings.max_backoff, self.settings.interval * 2 ** min(peer.failures, 16))
        peer.next_attempt = self.clock() + backoff * self.rng.uniform(0.5, 1.0)
        if peer.failures in (1, 10) or peer.failures % 100 == 0:
            log.warning("region %s: gossip to %s failed (%d in a row): %s", self.region, peer.name, peer.failures, exc)

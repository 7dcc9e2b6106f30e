"""The gossip engine: delta rounds, acknowledged outboxes, relay and anti-entropy.

Transport-agnostic: messages go through a :class:`~geolimit.replication.transport.Transport`,
so the same engine runs over HTTP in the agent and over an in-memory network in
simulations. Time comes from an injectable clock (seconds).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from geolimit.aio import cancel_and_wait
from geolimit.core.window import bucket_of
from geolimit.errors import GeolimitError, ProtocolError, StorageError
from geolimit.replication import wire
from geolimit.replication.digest import partition_digests, partition_of
from geolimit.replication.outbox import CellKey, Outbox
from geolimit.replication.peers import EngineSettings, PeerState
from geolimit.replication.redis_io import ReplicationStore
from geolimit.replication.transport import Transport, TransportError
from geolimit.replication.wire import Cell6

__all__ = ["EngineSettings", "GossipEngine", "PeerState"]

log = logging.getLogger("geolimit.gossip")

#: Age reported for a peer never heard from (about a year).
NEVER_HEARD_US = 365 * 86_400 * 1_000_000


class GossipEngine:
    """Replicates one region's cells to its peers and merges theirs."""

    def __init__(
        self,
        region: str,
        peers: Sequence[str],
        store: ReplicationStore,
        transport: Transport,
        settings: EngineSettings | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.region = region
        self.store = store
        self.transport = transport
        self.settings = settings or EngineSettings()
        self.clock = clock
        self._rng = rng or random.Random()
        self.peers = {name: PeerState(name, Outbox(self.settings.outbox_limit)) for name in peers}
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._prune_due = 0.0
        self.own_slots: dict[int, str] = {}
        self.stats: dict[str, float] = dict.fromkeys(
            ("rounds", "round_seconds", "drained", "unknown_rule", "merged", "increased",
             "dropped_old", "dropped_future", "relayed", "ae_runs", "ae_cells", "wipes"), 0.0
        )

    # -- rounds ---------------------------------------------------------------

    async def round(self) -> None:
        """One gossip round: drain local changes, queue them, start sends and anti-entropy."""
        if self._failure is not None:
            raise self._failure
        started = self.clock()
        now = started
        try:
            drained = await self.store.drain(int(self.settings.lease_ttl * 1_000_000), self.peer_ages(now))
        except StorageError:
            # The drain may have taken the changed keys before its reply was lost:
            # anti-entropy with every peer delivers them.
            for peer in self.peers.values():
                peer.ae_needed = True
            raise
        self._check_incarnations(drained.own_slots)
        self.stats["drained"] += len(drained.cells)
        self.stats["unknown_rule"] += drained.unknown
        if drained.cells:
            for peer in self.peers.values():
                peer.outbox.extend(_keyed(drained.cells), now)
        self._release_deferred(now)
        if now >= self._prune_due:
            self._prune(now)
        for peer in self.peers.values():
            due = peer.last_attempt is None or now - peer.last_attempt >= self.settings.heartbeat
            if not peer.sending and now >= peer.next_attempt and (len(peer.outbox) or due):
                peer.sending = True
                self._spawn(self._send(peer))
            if not peer.ae_running and now >= peer.next_attempt and (peer.ae_needed or now >= peer.ae_due):
                peer.ae_running = True
                self._spawn(self._anti_entropy(peer))
        self.stats["rounds"] += 1
        self.stats["round_seconds"] = self.clock() - started

    async def settle(self) -> None:
        """Wait until every send and anti-entropy task started so far has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._failure is not None:
            raise self._failure

    @property
    def tasks(self) -> set[asyncio.Task[None]]:
        """Sends and anti-entropy exchanges in progress."""
        return set(self._tasks)

    async def cancel(self) -> None:
        """Cancel every send and anti-entropy task (abort, or after a failed flush)."""
        await cancel_and_wait(list(self._tasks))

    async def flush(self, deadline: float) -> bool:
        """Shutdown: drain once, try to deliver every outbox before ``deadline`` (clock time)."""
        try:
            await asyncio.wait_for(self._flush(), timeout=max(0.0, deadline - self.clock()))
        except (TimeoutError, asyncio.TimeoutError):
            return False
        return all(not len(p.outbox) for p in self.peers.values())

    async def _flush(self) -> None:
        await self.settle()
        now = self.clock()
        drained = await self.store.drain(int(self.settings.lease_ttl * 1_000_000), self.peer_ages(now))
        for peer in self.peers.values():
            peer.outbox.extend(_keyed(drained.cells), now)
            for _, _, _, cells in peer.deferred:
                peer.outbox.extend(_keyed(cells), now)
            peer.deferred.clear()
            if len(peer.outbox) and not peer.sending:
                peer.sending = True
                self._spawn(self._send(peer))
        await self.settle()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("gossip task crashed", exc_info=self._failure)

    def peer_ages(self, now: float) -> dict[str, int]:
        """How old each peer's counts are here (µs), for prediction and partition policies.

        A peer's counts are current as of its last drain before it last sent to us
        directly: our receive time, minus half the round trip, minus up to one
        interval of drain lag. A peer never heard from is as stale as can be.
        """
        ages: dict[str, int] = {}
        for peer in self.peers.values():
            if peer.last_heard is None:
                ages[peer.name] = NEVER_HEARD_US
            else:
                lag = now - peer.last_heard + self.settings.interval + peer.rtt / 2
                ages[peer.name] = int(lag * 1_000_000)
        return ages

    def _check_incarnations(self, current: dict[int, str]) -> None:
        """A shard whose own slot changed lost its data: repair it from the peers."""
        wiped = [s for s, slot in current.items() if s in self.own_slots and self.own_slots[s] != slot]
        self.own_slots.update(current)
        if wiped:
            self.stats["wipes"] += 1
            log.warning("region %s: Redis lost the data of %d shards; repairing from peers", self.region, len(wiped))
            for peer in self.peers.values():
                peer.ae_needed = True

    # -- sending --------------------------------------------------------------

    def _reach(self, now: float) -> dict[str, float]:
        return {p.name: round(now - p.last_ok, 3) for p in self.peers.values() if p.last_ok is not None}

    def message(self, kind: str, cells: list[Cell6] | None = None) -> wire.Message:
        now = self.clock()
        return wire.Message(
            kind=kind,
            sender=self.region,
            now_us=int(now * 1_000_000),
            reach=self._reach(now),
            rules={n: r.structure for n, r in self.store.rules.items()},
            cells=cells or [],
        )

    async def _send(self, peer: PeerState) -> None:
        """Deliver the outbox in messages of at most ``max_cells_per_message`` cells."""
        try:
            while True:
                # A failing peer gets small messages until one succeeds, then the rest.
                limit = self.settings.probe_cells if peer.failures else self.settings.max_cells_per_message
                snapshot = peer.outbox.snapshot(limit)
                peer.last_attempt = sent_at = self.clock()
                cells = [(k[0], k[1], k[2], k[3], v, f) for k, v, f in snapshot]
                try:
                    reply = await self.transport.send(peer.name, self.message("delta", cells))
                except (TransportError, ProtocolError) as exc:
                    self._failed(peer, exc)
                    return
                took = self.clock() - sent_at
                peer.rtt = took if peer.rtt == 0.0 else 0.8 * peer.rtt + 0.2 * took
                peer.outbox.ack(snapshot)
                peer.cells_sent += len(cells)
                self._succeeded(peer, reply)
                if len(snapshot) < limit or not len(peer.outbox):
                    return
        finally:
            peer.sending = False

    def _succeeded(self, peer: PeerState, reply: wire.Message) -> None:
        now = self.clock()
        if peer.failures:
            log.info("region %s: peer %s reachable again after %d failures", self.region, peer.name, peer.failures)
            peer.ae_needed = True
        peer.failures = 0
        peer.last_ok = peer.last_heard = now
        peer.next_attempt = 0.0
        self._note_reach(peer, reply, now)

    def _failed(self, peer: PeerState, exc: BaseException) -> None:
        peer.failures += 1
        peer.errors += 1
        peer.last_error = str(exc)[:300]
        backoff = min(self.settings.max_backoff, self.settings.interval * 2 ** min(peer.failures, 16))
        peer.next_attempt = self.clock() + backoff * self._rng.uniform(0.5, 1.0)
        if peer.failures in (1, 10) or peer.failures % 100 == 0:
            log.warning("region %s: gossip to %s failed (%d in a row): %s", self.region, peer.name, peer.failures, exc)

    def _note_reach(self, peer: PeerState, msg: wire.Message, now: float) -> None:
        peer.reach = dict(msg.reach)
        peer.reach_at = now
        if msg.now_us:
            sample = msg.now_us / 1_000_000 - (now - peer.rtt / 2)
            peer.skew = sample if peer.skew == 0.0 else 0.8 * peer.skew + 0.2 * sample

    # -- receiving ------------------------------------------------------------

    async def receive(self, msg: wire.Message) -> wire.Message:
        """Handle a verified, decoded message from a peer and build the response."""
        now = self.clock()
        peer = self.peers.get(msg.sender)
        if peer is None:
            raise ProtocolError(f"message from unknown peer {msg.sender!r}")
        peer.last_heard = now
        self._note_reach(peer, msg, now)
        if msg.kind in ("delta", "cells"):
            await self._merge(peer, msg)
            return self.message("ack")
        if msg.kind == "digest":
            live = await self.store.read_live(msg.now_us)
            mine = partition_digests(live)
            want = sorted(p for p in set(mine) | set(msg.digests) if mine.get(p) != msg.digests.get(p))
            reply = self.message("ack", _cells_of(live, set(want)))
            reply.digests, reply.want = mine, want
            return reply
        raise ProtocolError(f"unexpected message kind {msg.kind!r}")

    async def _merge(self, peer: PeerState, msg: wire.Message) -> None:
        cells = self._accepted(msg)
        peer.cells_received += len(msg.cells)
        merged = await self.store.merge(cells)
        self.stats["merged"] += len(cells)
        self.stats["increased"] += len(merged.increased)
        self.stats["dropped_old"] += merged.dropped_old
        self.stats["dropped_future"] += merged.dropped_future
        self._relay(peer, merged.increased)

    def _accepted(self, msg: wire.Message) -> list[Cell6]:
        rules = self.store.rules
        bad = {n for n, structure in msg.rules.items() if n not in rules or rules[n].structure != structure}
        if bad:
            mismatched = sorted(n for n in bad if n in rules)
            if mismatched:
                log.warning("region %s: %s sent rules %s with another window/resolution; ignored",
                            self.region, msg.sender, mismatched)
            skipped = sum(1 for c in msg.cells if c[0] in bad)
            self.stats["unknown_rule"] += skipped
            return [c for c in msg.cells if c[0] not in bad]
        return msg.cells

    def _relay(self, source: PeerState, cells: list[Cell6]) -> None:
        """Forward cells learned from ``source`` to the other peers.

        Never back to ``source``, and never to the region that owns a cell's slot
        (its own counts). When ``source`` reports a fresh link to a peer it will
        deliver the cells itself, so the relay is deferred: dropped once ``source``
        reports a delivery to that peer made after we received them, released as
        soon as ``source`` reports without one, or at a deadline if it goes quiet.
        """
        if not cells:
            return
        now = self.clock()
        fresh = 2 * self.settings.heartbeat + 2 * self.settings.interval
        for peer in self.peers.values():
            if peer is source:
                continue
            owned = peer.name + "/"
            mine = [c for c in cells if not c[3].startswith(owned)]
            if not mine:
                continue
            acked = source.acked_from(peer.name)
            if acked is not None and now - acked <= fresh:
                deadline = now + self.settings.relay_grace * max(self.settings.interval, self.settings.heartbeat)
                peer.deferred.append((deadline, source.name, now, mine))
            else:
                peer.outbox.extend(_keyed(mine), now)
                self.stats["relayed"] += len(mine)

    def _release_deferred(self, now: float) -> None:
        step = self.settings.interval
        for peer in self.peers.values():
            if not peer.deferred:
                continue
            keep: list[tuple[float, str, float, list[Cell6]]] = []
            for item in peer.deferred:
                deadline, source_name, received, cells = item
                source = self.peers[source_name]
                acked = source.acked_from(peer.name)
                if acked is not None and acked > received + step:
                    continue  # the origin delivered them itself
                if now >= deadline or source.reach_at >= received + 2 * step:
                    peer.outbox.extend(_keyed(cells), now)
                    self.stats["relayed"] += len(cells)
                else:
                    keep.append(item)
            peer.deferred = keep

    # -- anti-entropy ---------------------------------------------------------

    async def _anti_entropy(self, peer: PeerState) -> None:
        # Clear the request when the run *starts*: a wipe detected while this run is
        # in flight asks again, and this run (which read the data before the wipe)
        # must not swallow that request when it ends.
        peer.ae_needed = False
        ok = False
        try:
            ok = await self.anti_entropy(peer.name)
        finally:
            peer.ae_running = False
            if not ok:
                peer.ae_needed = True
        peer.ae_concluded = True
        if ok:
            peer.ae_ok += 1
            peer.ae_due = self.clock() + self.settings.anti_entropy_interval * self._rng.uniform(0.8, 1.2)

    async def anti_entropy(self, name: str) -> bool:
        """Exchange digests with a peer, then the cells of every partition that differs."""
        peer = self.peers[name]
        self.stats["ae_runs"] += 1
        now_us = int(self.clock() * 1_000_000)
        try:
            live = await self.store.read_live(now_us)
            request = self.message("digest")
            request.now_us, request.digests = now_us, partition_digests(live)
            reply = await self.transport.send(name, request)
            self._succeeded(peer, reply)
            await self._merge(peer, reply)
            self.stats["ae_cells"] += len(reply.cells)
            mine = _cells_of(live, set(reply.want))
            limit = self.settings.max_cells_per_message
            for start in range(0, len(mine), limit):
                await self.transport.send(name, self.message("cells", mine[start : start + limit]))
            self.stats["ae_cells"] += len(mine)
        except (TransportError, ProtocolError) as exc:
            self._failed(peer, exc)
            return False
        except StorageError as exc:
            log.warning("region %s: anti-entropy with %s failed: %s", self.region, name, exc)
            return False
        return True

    # -- housekeeping ---------------------------------------------------------

    def _prune(self, now: float) -> None:
        rules = self.store.rules
        oldest = {n: bucket_of(int(now * 1e6), r.resolution_us) - r.buckets - r.future for n, r in rules.items()}

        def expired(key: CellKey) -> bool:
            floor = oldest.get(key[0])
            return floor is None or key[2] < floor

        for peer in self.peers.values():
            peer.outbox.prune(expired)
        self._prune_due = now + 1.0

    @property
    def initial_sync_done(self) -> bool:
        return all(p.ae_concluded for p in self.peers.values())

    def check_failure(self) -> None:
        if self._failure is not None:
            raise GeolimitError(f"gossip task crashed: {self._failure!r}") from self._failure


def _keyed(cells: Iterable[Cell6]) -> Iterable[tuple[CellKey, int, int]]:
    return (((c[0], c[1], c[2], c[3]), c[4], c[5]) for c in cells)


def _cells_of(live: dict[tuple[str, bytes], list[tuple[int, str, int, int]]], parts: set[int]) -> list[Cell6]:
    return [
        (rule, subject, bucket, slot, value, floor)
        for (rule, subject), cells in live.items()
        if partition_of(subject) in parts
        for bucket, slot, value, floor in cells
    ]

"""The gossip engine: delta rounds over durable outboxes, relay and anti-entropy.

Transport-agnostic: messages go through a :class:`~geolimit.replication.transport.Transport`,
so the same engine runs over HTTP in the agent and over an in-memory network in
simulations. Time comes from an injectable clock (seconds).

The engine moves bytes. Redis holds every peer's outbox (``drain.lua``), packs
a peer's batch into blobs (``pack.lua``), remembers what is in flight until the
peer acknowledges it (``settle.lua``) and merges what peers send (``merge.lua``).
A crash loses nothing: outboxes and in-flight batches live in Redis, and a
restarted engine returns every in-flight batch to its outbox before it sends.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from geolimit.aio import cancel_and_wait
from geolimit.core.rule import Rule
from geolimit.errors import StorageError
from geolimit.replication import wire
from geolimit.replication.antientropy import AntiEntropyResult
from geolimit.replication.clock_steps import SteppedClock
from geolimit.replication.clock_sync import agreed_correction
from geolimit.replication.gossip_repair import AntiEntropyDriver
from geolimit.replication.gossip_send import Sender
from geolimit.replication.heard import SharedHeard
from geolimit.replication.peers import EngineSettings, PeerState
from geolimit.replication.redis_io import MAX_WINDOW, ReplicationStore
from geolimit.replication.takeover import FreshnessTakeover, down_workers, worker_field
from geolimit.replication.transport import Transport
from geolimit.replication.wire import Blob

__all__ = ["EngineSettings", "GossipEngine", "PeerState"]

log = logging.getLogger("geolimit.gossip")

#: Shards whose registries reclaim.lua looks at per page, and the seconds between pages.
RECLAIM_SHARDS = 256
RECLAIM_EVERY = 10.0
#: Shards whose outbox for an unreachable peer is pruned each round (a page each).
PRUNE_SHARDS = 4

#: The parts of the workers' shared state (GossipEngine.note_sharing), as the log names them.
_SHARED_PARTS = {"freshness": "peers' freshness", "requests": "peers' anti-entropy requests",
                 "takeover": "peers' freshness for a down worker's shards"}

#: Age reported for a peer never heard from (about a year).
NEVER_HEARD_US = 365 * 86_400 * 1_000_000


class GossipEngine(Sender):
    """Replicates one region's cells to its peers and merges theirs (see :class:`Receiver`)."""

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
        if not 1 <= self.settings.window <= MAX_WINDOW:
            raise ValueError(f"window must be from 1 to {MAX_WINDOW}")
        #: The engine's clock, watched for steps back (clock_steps.py).
        self.clock = SteppedClock(clock, self._shift_times, f"region {region}")
        self.rng = rng or random.Random()
        self.peers = {name: PeerState(name) for name in peers}
        self._tasks: set[asyncio.Task[None]] = set()
        self._recovered = False
        self.own_slots: dict[int, str] = {}
        self.task_failures = 0
        #: Seconds added to this region's clock for everything that names buckets (clock_sync.py).
        self.clock_correction = 0.0
        self.last_task_error: str | None = None
        self.stats: dict[str, float] = dict.fromkeys(
            ("rounds", "round_seconds", "drained", "unknown_rule", "merged", "increased", "bad_values", "relayed",
             "dropped_old", "dropped_future", "own_ahead", "ae_runs", "ae_failed", "ae_cells", "ae_keys_repaired",
             "wipes", "refused", "refused_by_peers", "pruned", "parked", "unparked", "slots_reclaimed", "junk_keys"), 0.0
        )
        self.failed_shards: set[int] = set()  # shards whose Redis calls failed in the last drain
        self._reclaim_next = 0  # index into the owned shards of the next page to reclaim slots in
        self._reclaim_at = 0.0  # when (engine clock) the next page is due
        self.repair = AntiEntropyDriver(self)
        self.heard = SharedHeard(store.store, store.layout)  # with several workers (heard.py)
        self.sharing_errors: dict[str, str] = {}  # what of the workers' shared state is out of reach, and why
        self.takeover = FreshnessTakeover(store.store, store.layout, self.settings.worker, self.settings.workers)
        self.worker_stamps: dict[int, float | None] = {}  # each worker's last round, as last shared
        #: Workers of this region that are down (takeover.py): while any is, this worker's
        #: deltas say they are partial, and peers do not take this region as current from them.
        self.workers_down: frozenset[int] = frozenset()

    # -- rounds ---------------------------------------------------------------

    async def round(self) -> None:
        """One gossip round: fan local changes out to the outboxes, start sends and anti-entropy."""
        started = now = self.clock()
        await self._drain(now)  # first: it renews the lease under which apps record changes
        await self._take_over(now)
        if not self._recovered:  # batches a previous agent left in flight go back to the outboxes
            await self.store.recover(self.settings.window)
            await self.store.parked.find()
            self._recovered = True
            await self._drain(now)
        await self._resettle()
        if self.store.parked.due:  # cells that were ahead of the clock-skew tolerance, now due
            relay = sorted({p for peer in self.peers.values() for p in self.relays(peer)})
            self.stats["unparked"] += await self.store.parked.release(round(self.region_clock() * 1_000_000), relay)
        self._start_sends(now)
        await self._prune()
        self.lapse_down_reports(now)
        await self.repair.share_requests()
        self.repair.start_due(now)
        await self._reclaim(now)
        self.stats["junk_keys"] += self.store.junk.take()  # (pack, settle, merge, unpark: drain's above)
        self.stats["rounds"] += 1
        self.stats["round_seconds"] = self.clock() - started

    async def _drain(self, now: float) -> None:
        lease = int(self.settings.lease_ttl * 1_000_000)
        if self.settings.several_workers:
            await self._share_heard()
        try:
            self.clock_correction = agreed_correction(
                (p.skew for p in self.peers.values() if p.skew_known), len(self.peers) + 1
            )
            correction_us = round(self.clock_correction * 1_000_000)
            for _ in range(self.settings.drain_passes):
                drained = await self.store.drain(lease, self.peer_ages(now), correction_us)
                self.stats["drained"] += drained.taken
                self.stats["junk_keys"] += drained.junk
                if not drained.changed_left:
                    break
        except StorageError:
            for peer in self.peers.values():
                peer.ae_needed = True
            raise
        self._note_failed_shards(drained.failed)
        self._check_incarnations(drained.own_slots)
        for peer in self.peers.values():
            peer.pending = drained.pending.get(peer.name, {})
            peer.oldest_us = drained.oldest_us.get(peer.name)

    async def _share_heard(self) -> None:
        """With several workers: a peer's deltas reach one of them; take the latest time any
        worker heard from each peer (heard.py), before this worker publishes their ages. The
        same call stamps this worker's round and reads the others' (takeover.py)."""
        me, workers = self.settings.worker, self.settings.workers
        mine: dict[str, float | None] = {p.name: p.last_heard for p in self.peers.values()}
        now = self.clock()
        for i in range(workers):
            mine[worker_field(i)] = now if i == me else None
        try:
            latest = await self.heard.exchange(mine, now)
        except StorageError as exc:
            self.note_sharing("freshness", str(exc))
            return
        self.note_sharing("freshness", None)
        self.worker_stamps = {i: latest.get(worker_field(i)) for i in range(workers)}
        for name, when in latest.items():
            peer = self.peers.get(name)
            if peer is not None and (peer.last_heard is None or when > peer.last_heard):
                peer.last_heard = when

    async def _take_over(self, now: float) -> None:
        """With several workers: publish the peers' freshness for the shards of workers that
        are down, if this is the lowest-numbered one that is up (takeover.py)."""
        if not self.settings.several_workers:
            return
        down = down_workers(self.worker_stamps, self.clock(), self.settings.interval, self.settings.heartbeat,
                            self.settings.workers, self.settings.worker)
        if down != self.workers_down:
            if down:
                log.warning("region %s: worker(s) %s down: its deltas tell peers they are partial (their counts "
                            "of this region age) until every worker is back", self.region,
                            ", ".join(map(str, sorted(down))))
            else:
                log.info("region %s: every worker is up again", self.region)
            self.workers_down = down
        shards = self.takeover.orphans(self.worker_stamps, self.clock(), self.settings.interval,
                                       self.settings.heartbeat)
        if not shards:
            return
        try:
            await self.takeover.publish(shards, self.peer_ages(now), round(self.clock_correction * 1_000_000),
                                        self.store.clock_arg())
        except StorageError as exc:
            self.note_sharing("takeover", str(exc))
            return
        self.note_sharing("takeover", None)

    def note_sharing(self, what: str, error: str | None) -> None:
        """``what`` of the workers' shared state (``freshness``, ``requests``; shard 0's node)
        out of reach (``error``) or back (None): one line when that changes. Gossip goes on
        meanwhile, on what this worker learns by itself."""
        had = self.sharing_errors.get(what)
        part = _SHARED_PARTS.get(what, what)
        if error is not None and had is None:
            log.warning("region %s: cannot share %s with the other workers (gossip goes on): %s",
                        self.region, part, error)
            self.sharing_errors[what] = error
        elif error is None and had is not None:
            log.info("region %s: sharing %s with the other workers again", self.region, part)
            del self.sharing_errors[what]

    def _shift_times(self, by: float) -> None:
        """The host's clock stepped (clock_steps.py): every time recorded for the peers moves with it."""
        for peer in self.peers.values():
            peer.shift_times(by)

    def _note_failed_shards(self, failed: dict[int, str]) -> None:
        """Shards whose Redis (a Cluster node) failed this round: the others' gossip goes on."""
        if set(failed) != self.failed_shards:
            if failed:
                log.warning("region %s: %d shards unreachable (gossip goes on for the others): %s",
                            self.region, len(failed), next(iter(failed.values())))
            else:
                log.info("region %s: every shard reachable again", self.region)
            self.failed_shards = set(failed)

    async def _prune(self) -> None:
        """While a peer is unreachable, drop its outbox entries of keys that expired.

        Nothing is packed for it meanwhile (only small probes), so without this an
        outbox would keep an entry for every key changed during the partition.
        Bounded: a page of each of :data:`PRUNE_SHARDS` shards per peer and round.
        """
        owned = self.store.owned
        for peer in self.peers.values():
            if not peer.failures or not owned:
                continue
            shards = [owned[(peer.prune_next + i) % len(owned)] for i in range(min(PRUNE_SHARDS, len(owned)))]
            peer.prune_next = (peer.prune_next + len(shards)) % len(owned)
            self.stats["pruned"] += await self.store.prune(peer.name, peer.prune_cursors, shards)

    async def _reclaim(self, now: float) -> None:
        """Take back the slot indices of long-idle incarnations (each wipe of a region adds
        one per shard to its peers' registries): a page of RECLAIM_SHARDS shards every
        RECLAIM_EVERY seconds, so every shard's registry is looked at within minutes."""
        owned = self.store.owned
        if now < self._reclaim_at or not owned:
            return
        self._reclaim_at = now + RECLAIM_EVERY
        shards = [owned[(self._reclaim_next + i) % len(owned)] for i in range(min(RECLAIM_SHARDS, len(owned)))]
        self._reclaim_next = (self._reclaim_next + len(shards)) % len(owned)
        self.stats["slots_reclaimed"] += await self.store.reclaim(shards)

    async def _resettle(self) -> None:
        """Return in-flight batches whose outcome could not be recorded (Redis, or a node
        of it, was down). A slot that still fails stays unsettled for the next round
        (returning a batch twice is harmless), and the round goes on."""
        for peer in self.peers.values():
            for slot in sorted(peer.unsettled):
                try:
                    await self.store.settle(peer.name, slot, self.store.owned, delivered=False)
                except StorageError:
                    continue
                peer.unsettled.discard(slot)

    def _start_sends(self, now: float) -> None:
        per_message = self.settings.max_cells_per_message
        for peer in self.peers.values():
            if now < peer.next_attempt:
                continue
            window = 1 if peer.failures else self.settings.window
            # A failing peer is probed at its backoff pace, even with nothing queued.
            due = peer.last_attempt is None or peer.failures > 0 or now - peer.last_attempt >= self.settings.heartbeat
            wanted = -(-peer.unsent // per_message) if peer.unsent else (1 if due and not peer.flying else 0)
            free = [s for s in range(self.settings.window) if s not in peer.flying and s not in peer.unsettled]
            if not peer.flying and peer.unsent:
                peer.start_ramp(per_message)
            for slot in free[: max(0, min(wanted, window - len(peer.flying)))]:
                peer.flying.add(slot)
                self.spawn(self._send(peer, slot))

    async def settle(self) -> None:
        """Wait until every send and anti-entropy task started so far has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    @property
    def tasks(self) -> set[asyncio.Task[None]]:
        """Sends and anti-entropy exchanges in progress."""
        return set(self._tasks)

    async def cancel(self) -> None:
        """Cancel every send and anti-entropy task (abort, or after a failed flush)."""
        await cancel_and_wait(list(self._tasks))

    async def flush(self, deadline: float) -> bool:
        """Shutdown: deliver every outbox before ``deadline`` (clock time), if the peers answer."""
        try:
            await asyncio.wait_for(self._flush(), timeout=max(0.0, deadline - self.clock()))
        except (TimeoutError, asyncio.TimeoutError):
            return False
        return all(not p.queued for p in self.peers.values())

    async def _flush(self) -> None:
        await self.settle()
        while True:
            now = self.clock()
            await self._drain(now)
            if not any(p.queued for p in self.peers.values()):
                return
            for peer in self.peers.values():
                peer.next_attempt = 0.0
            self._start_sends(now)
            await self.settle()
            if all(p.failures for p in self.peers.values() if p.queued):
                return

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Reported and retried (the next round starts a new one), never fatal.
            exc = task.exception()
            self.task_failures += 1
            self.last_task_error = f"{type(exc).__name__}: {exc}"[:300]
            if isinstance(exc, StorageError):  # Redis down: expected, and reported by the rounds too
                log.warning("region %s: gossip task failed (%d so far); it is retried: %s", self.region,
                            self.task_failures, self.last_task_error)
            else:
                log.error("region %s: gossip task failed (%d so far); it is retried", self.region,
                          self.task_failures, exc_info=exc)

    def peer_ages(self, now: float) -> dict[str, int]:
        """How old each peer's counts are here (µs), for prediction and partition policies.

        A peer's counts are current as of its last drain before it last sent to us
        directly: our receive time, minus half the round trip, minus up to one
        interval of drain lag. A peer never heard from is as stale as can be. Only
        its deltas (heartbeats included) count: its answers to our messages carry
        none of its counts, and a peer whose own messages cannot reach us answers
        ours all the same.
        """
        ages: dict[str, int] = {}
        for peer in self.peers.values():
            if peer.last_heard is None:
                ages[peer.name] = NEVER_HEARD_US
            else:
                lag = max(0.0, now - peer.last_heard) + self.settings.interval + peer.rtt / 2
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
                peer.ae_after_wipe = True

    # -- sending --------------------------------------------------------------

    def region_clock(self) -> float:
        """The agreed region clock (seconds): this host's clock plus :attr:`clock_correction`."""
        return self.clock() + self.clock_correction

    def _reach(self, now: float) -> dict[str, float]:
        return {p.name: max(0.0, round(now - p.last_ok, 3)) for p in self.peers.values() if p.last_ok is not None}

    def message(self, kind: str, dest: str, blobs: list[Blob] | None = None) -> wire.Message:
        now = self.clock()
        return wire.Message(
            kind=kind,
            sender=self.region,
            dest=dest,
            now_us=int(now * 1_000_000),
            reach=self._reach(now),
            failing=[p.name for p in self.peers.values() if p.failures],
            rules={n: r.structure for n, r in self.store.rules.items()},
            shards=self.store.layout.shards,
            blobs=blobs or [],
            partial=kind == "delta" and bool(self.workers_down),
        )

    # -- anti-entropy ---------------------------------------------------------

    async def anti_entropy(self, name: str) -> AntiEntropyResult:
        """One full anti-entropy exchange with peer ``name`` (raises on failure)."""
        return await self.repair.ae.run(name)

    async def close(self) -> None:
        """Drop the anti-entropy exchanges this region serves."""
        await self.repair.ae.close()

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        """Replicate (and compare) a new rule set."""
        self.store.set_rules(rules)
        self.repair.ae.set_rules(rules)

    # -- status ---------------------------------------------------------------

    @property
    def initial_sync_done(self) -> bool:
        """Every peer had a first anti-entropy exchange (concluded, even if it failed)."""
        return not self.settings.anti_entropy or all(p.ae_concluded for p in self.peers.values())


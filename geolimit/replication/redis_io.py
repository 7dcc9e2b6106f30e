"""The replication agent's Redis operations: a thin shell over the scripts.

Redis does the per-cell work: ``drain.lua`` fans a shard's changed keys out into
durable per-peer outboxes, ``pack.lua`` turns a bounded batch of a peer's outbox
into one msgpack blob, ``settle.lua`` acknowledges or returns an in-flight batch,
and ``merge.lua`` validates a peer's blob and max-merges it. Python moves bytes:
it never builds an object per cell on these paths. Every script call does
bounded work (``max_keys`` keys, ``max_cells`` cells), so Redis is never held
for long and a decision waits at most about a millisecond behind replication.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.core.usage import slot_names
from geolimit.core.window import bucket_of, read_key
from geolimit.errors import ProtocolError, StorageError
from geolimit.replication.blob_check import vet_blob
from geolimit.replication.blob_format import blobs_from_cells, pack_blob, unpack_blob
from geolimit.replication.digest import live_range, partition_of
from geolimit.replication.parking import ParkedCells
from geolimit.replication.store_results import Drained, JunkKeys, Limits, MergeResult, Packed
from geolimit.replication.wire import Blob
from geolimit.store.async_store import AsyncStore, checked_replies, surviving
from geolimit.store.redis_store import describe_error
from geolimit.store.scripts import load_script

__all__ = ["Drained", "Limits", "MergeResult", "Packed", "ReplicationStore", "blobs_from_cells", "pack_blob", "unpack_blob"]

log = logging.getLogger("geolimit.gossip")

_DRAIN = load_script("drain")
_PACK = load_script("pack")
_SETTLE = load_script("settle")
_MERGE = load_script("merge")
_PRUNE = load_script("prune")
_RECLAIM = load_script("reclaim")

#: In-flight message slots per peer (drain.lua forgets slots 0..7 of removed peers).
MAX_WINDOW = 8

#: Blob bytes vetted in Python between two yields of the event loop (about 7 ms of work).
VET_YIELD_BYTES = 256 * 1024

#: Cells of peers' blobs that one trip of merge calls may carry (about 25 ms of Redis
#: time): Redis runs a pipelined trip whole, so a decision waits behind whole trips,
#: MERGE_TRIPS_IN_FLIGHT at most.
MERGE_TRIP_CELLS = 4096
#: Trips of merge calls one agent process has in Redis at once. One was too few: a trip
#: under load takes about 100 ms, mostly waiting its turn, so one at a time merged slower
#: than three loaded regions wrote (bench/soak.py's lag grew by about 1 s every second);
#: two keep up there, and a decision waits behind two trips of each agent process at most
#: (bench/flood.py; with ``--workers N``, 2N).
MERGE_TRIPS_IN_FLIGHT = 2
#: What one merge call costs Redis besides its cells (its arguments, the registry), in
#: cells: a trip of small blobs carries at most MERGE_TRIP_CELLS / this many calls.
MERGE_CALL_CELLS = 16


def merge_trips(cells: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive calls (``cells[i]`` cells each) grouped into trips of at most
    MERGE_TRIP_CELLS, counting MERGE_CALL_CELLS per call; a bigger call goes alone.

    Sized by each trip's own cells: sizing every trip by a message's biggest blob
    sent a message of 63 small blobs and one of 2,000 cells in 32 trips a pass (64 in
    all) instead of one, and one trip at a time could not keep up with a loaded link
    (bench/soak.py).
    """
    trips: list[tuple[int, int]] = []
    start, load = 0, 0
    for i, n in enumerate(cells):
        cost = n + MERGE_CALL_CELLS
        if i > start and load + cost > MERGE_TRIP_CELLS:
            trips.append((start, i))
            start, load = i, 0
        load += cost
    if start < len(cells):
        trips.append((start, len(cells)))
    return trips


class ReplicationStore:
    """Drain, pack, settle and merge one region's Redis for the agent."""

    def __init__(
        self,
        store: AsyncStore,
        layout: KeyLayout,
        region: str,
        rules: Mapping[str, Rule],
        nonce: bytes,
        now_us: Callable[[], int | None] = lambda: None,
        peers: Sequence[str] = (),
        limits: Limits | None = None,
        owned: Sequence[int] | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        #: The shards whose outboxes this agent (worker) drains, packs and recovers.
        self.owned = sorted(set(owned)) if owned is not None else list(range(layout.shards))
        #: Cells ahead of the clock-skew tolerance, kept until their bucket comes.
        self.parked = ParkedCells(self)
        #: Keys of another type (junk) that pack, settle, merge and unpark deleted.
        self.junk = JunkKeys(region)
        if any(not 0 <= s < layout.shards for s in self.owned):
            raise ValueError(f"owned shards must be in [0, {layout.shards})")
        self.region = region
        self._region_b = region.encode()
        self._nonce = nonce
        self._now = now_us
        self.limits = limits or Limits()
        self.peers = list(peers)
        self._regions = [region.encode(), *(p.encode() for p in self.peers)]
        self._allowed = frozenset(self._regions)
        # At most MERGE_TRIPS_IN_FLIGHT trips of merge calls at a time, whatever the number
        # of messages being merged (peers' deltas, anti-entropy, unparking): decisions
        # never queue behind more than that.
        self._merge_gate = asyncio.Semaphore(MERGE_TRIPS_IN_FLIGHT)
        self.set_rules(rules)

    def set_rules(self, rules: Mapping[str, Rule]) -> None:
        self.rules = dict(rules)
        pack: list[bytes] = [b"%d" % len(self.rules)]
        for name, rule in self.rules.items():
            pack += (name.encode(), b"%d" % rule.resolution_us, b"%d" % rule.buckets, b"%d" % rule.ring)
        self._pack_rules = pack

    def _merge_rules(self, accepted: Iterable[str]) -> list[bytes]:
        names = [n for n in accepted if n in self.rules]
        out: list[bytes] = [b"%d" % len(names)]
        for name in names:
            r = self.rules[name]
            out += (name.encode(), b"%d" % r.resolution_us, b"%d" % r.buckets, b"%d" % r.ring,
                    b"%d" % r.future, b"%d" % r.ttl_ms, b"1" if r.predict else b"0")
        return out

    def clock_arg(self) -> bytes:
        """The scripts' clock argument: the injected clock's µs, or empty for Redis TIME."""
        now = self._now()
        return b"" if now is None else b"%d" % now

    def _registry(self, shard: int) -> bytes:
        return self.layout.registry_key(shard)

    # -- the sender's side ------------------------------------------------------

    async def drain(
        self, lease_us: int = 15_000_000, peer_ages: Mapping[str, int] | None = None, clock_correction_us: int = 0
    ) -> Drained:
        """Fan changed keys out into the peers' outboxes: one bounded call per shard.

        Also renews the lease that makes apps record changes (for ``lease_us``),
        publishes ``peer_ages`` (how old, in µs, each peer's counts here are),
        sets the region clock's correction and forgets peers that are no longer
        configured.
        """
        ages = peer_ages or {}
        fresh: list[bytes] = [b"%d" % (len(self.peers) + 1), b"%d" % clock_correction_us, b"%d" % len(self.peers)]
        for peer in self.peers:
            fresh += (peer.encode(), b"%d" % ages.get(peer, 0))
        head = [self.clock_arg(), self._region_b, self._nonce, new_incarnation(self._nonce), b"%d" % lease_us,
                b"%d" % self.limits.drain_keys, *fresh]
        calls = [[b"3", *self.layout.aux_keys(s), *head] for s in self.owned]
        out = Drained(pending={p: {} for p in self.peers}, oldest_us=dict.fromkeys(self.peers))
        for shard, reply in zip(self.owned, surviving(await self.store.run_many(_DRAIN, calls), self.owned, out.failed),
                                strict=True):
            if reply is None:
                continue
            out.own_slots[shard] = reply[0].decode()
            if len(reply) > 3 + 2 * len(self.peers):  # keys of another type, deleted and rewritten
                out.junk += len(reply[-1])
                log.warning("region %s: shard %d: %s held another type (junk): deleted and rewritten",
                            self.region, shard, b", ".join(reply[-1]).decode(errors="replace"))
            out.changed_left += int(reply[1])
            out.taken += int(reply[2])
            for i, peer in enumerate(self.peers):
                queued, since = int(reply[3 + 2 * i]), int(reply[4 + 2 * i])
                if queued:
                    out.pending[peer][shard] = queued
                if since >= 0:
                    old = out.oldest_us[peer]
                    out.oldest_us[peer] = since if old is None else min(old, since)
        return out

    async def pack(
        self, peer: str, slot: int, shards: Sequence[int], max_cells: int | Sequence[int] | None = None
    ) -> Packed:
        """Take a batch of ``peer``'s outbox in ``shards`` into in-flight ``slot``.

        ``max_cells``: the cells each shard's call may put in its blob, one number
        for all or one per shard (never more than ``limits.pack_cells``).
        """
        caps = [max_cells] * len(shards) if max_cells is None or isinstance(max_cells, int) else list(max_cells)
        if len(caps) != len(shards):
            raise ValueError("max_cells needs one cap per shard")
        clock, name, w, keys = self.clock_arg(), peer.encode(), b"%d" % slot, b"%d" % self.limits.pack_keys
        calls = [
            [b"1", self._registry(s), clock, name, w, keys, b"%d" % min(cap or self.limits.pack_cells,
                                                                        self.limits.pack_cells), *self._pack_rules]
            for s, cap in zip(shards, caps, strict=True)
        ]
        out = Packed()
        for shard, reply in zip(shards, checked_replies(await self.store.run_many(_PACK, calls)), strict=True):
            out.left[shard] = int(reply[3])
            if len(reply) > 7:  # the in-flight slot held another type (junk): deleted
                self.junk.note(shard, reply[7], "pack")
            out.unknown += int(reply[4])
            out.bad += int(reply[5])
            if reply[0]:
                out.blobs.append((shard, bytes(reply[0])))
                out.shards[shard] = out.shards.get(shard, 0) + int(reply[1])
                out.keys += int(reply[1])
                out.cells += int(reply[2])
                queued = int(reply[6])
                if queued >= 0 and (out.queued_us is None or queued < out.queued_us):
                    out.queued_us = queued
        return out

    async def settle(self, peer: str, slot: int, shards: Iterable[int], delivered: bool) -> None:
        """Acknowledge (forget) or return (re-queue) what in-flight ``slot`` holds."""
        mode = b"ack" if delivered else b"nack"
        shards = list(shards)
        calls = [[b"1", self._registry(s), self.clock_arg(), peer.encode(), b"%d" % slot, mode] for s in shards]
        for shard, reply in zip(shards, checked_replies(await self.store.run_many(_SETTLE, calls)), strict=True):
            if isinstance(reply, list):  # {fields, keys of another type (junk) deleted}
                self.junk.note(shard, reply[1], "settle")

    def reclaim_idle_us(self) -> int:
        """How long a slot must have written nothing in a shard before its index is taken
        back: twice the longest key TTL (a key outlives its last write by at most a
        quarter of its TTL), the parking span and a minute."""
        ttl_us = max((r.ttl_ms * 1000 for r in self.rules.values() if not r.escrow), default=0)
        return 2 * ttl_us + int((self.limits.park_seconds + 60) * 1_000_000)

    async def reclaim(self, shards: Sequence[int]) -> int:
        """Take back the registry indices of slots long idle in ``shards`` (``reclaim.lua``:
        wipes add a slot id per shard each, and a full registry refuses new ones).
        Returns the slot ids reclaimed."""
        idle = b"%d" % self.reclaim_idle_us()
        calls = [[b"1", self._registry(s), self.clock_arg(), idle, self.region.encode()] for s in shards]
        replies = surviving(await self.store.run_many(_RECLAIM, calls), shards, {})
        return sum(int(reply[0]) for reply in replies if reply is not None)

    async def prune(self, peer: str, cursors: dict[int, bytes], shards: Sequence[int], count: int = 500) -> int:
        """Drop ``peer``'s outbox entries of keys that expired, one ``HSCAN`` page per shard.

        ``cursors`` (shard -> cursor) carries each shard's scan from call to call.
        Returns the entries dropped.
        """
        name = peer.encode()
        calls = [[b"1", self._registry(s), name, cursors.get(s, b"0"), b"%d" % count] for s in shards]
        dropped = 0
        for shard, reply in zip(shards, surviving(await self.store.run_many(_PRUNE, calls), shards, {}), strict=True):
            if reply is not None:
                cursors[shard] = bytes(reply[0])
                dropped += int(reply[2])
        return dropped

    async def recover(self, window: int = MAX_WINDOW) -> None:
        """Return every in-flight batch to its outbox (after a crash or restart)."""
        for peer in self.peers:
            for slot in range(window):
                await self.settle(peer, slot, self.owned, delivered=False)

    # -- the receiver's side ----------------------------------------------------

    async def merge_blobs(
        self,
        blobs: Sequence[Blob],
        source: str,
        relay_to: Sequence[str] = (),
        rules: Iterable[str] | None = None,
        admit: Callable[[], Awaitable[object]] | None = None,
        *,
        repair: bool = False,
        gap_us: int = 0,
    ) -> MergeResult:
        """Validate every blob, then max-merge them; nothing is written unless all pass.

        ``rules``: the rule names whose structure the sender shares (default: all of
        ours); cells of other rules are skipped and counted. Keys whose state rose
        are queued for the peers in ``relay_to``. A refused blob raises
        :class:`ProtocolError` naming the reason. ``admit`` runs between the checks
        and the writes (the replay guard: a refused message leaves no trace).

        A cell claiming more in this region's own current slot than it counted
        refuses the blob (a delta must never do that). With ``repair`` (anti-entropy
        after a Redis failover or a restore from a snapshot lost this region's
        latest writes, so peers legitimately hold more) such cells are skipped,
        never written, and counted in :attr:`MergeResult.own_ahead`; the rest is merged.

        ``gap_us`` > 0 says the blobs are an update of ``source`` that came ``gap_us``
        after its previous one: each key records, per peer slot whose count rose,
        the rise and when, for prediction (:class:`geolimit.core.policy.Rise`).
        """
        if not blobs:
            if admit is not None:
                await admit()
            return MergeResult()
        lim = self.limits
        rule_args = self._merge_rules(self.rules if rules is None else rules)
        relay = [b"%d" % len(relay_to), *(p.encode() for p in relay_to)]
        regions = [b"%d" % len(self._regions), *self._regions]
        mode = b"repair" if repair else b"delta"

        def calls(apply: bytes, bodies: Sequence[Blob]) -> list[list[bytes]]:
            head = [self.clock_arg(), self._region_b, self._nonce, apply, mode, b"%d" % lim.blob_cells,
                    b"%d" % lim.new_slots, b"%d" % lim.max_slots, b"%d" % lim.park_cells,
                    b"%d" % round(lim.park_seconds * 1_000_000), *regions, *rule_args, *relay]
            tail = [b"%d" % gap_us] if apply != b"0" and gap_us > 0 else []
            return [[b"1", self._registry(shard), *head, blob, *tail] for shard, blob in bodies]

        checks: list[Blob] = []
        check_cells: list[int] = []  # per check: the cells merge.lua looks at in it
        blob_cells: list[int] = []
        slot_ids: dict[int, dict[bytes, None]] = {}  # shard -> the slot ids of its blobs, in order
        vetted_bytes = 0
        for shard, blob in blobs:
            # Vetting is Python work (about 27 ms per MB): a big message yields the loop
            # every VET_YIELD_BYTES, so decisions do not wait behind it.
            vetted_bytes += len(blob)
            if vetted_bytes >= VET_YIELD_BYTES:
                vetted_bytes = 0
                await asyncio.sleep(0)
            if not 0 <= shard < self.layout.shards:
                raise ProtocolError(f"blob for shard {shard}, but this region has {self.layout.shards} shards")
            try:
                vetted = vet_blob(blob, self._allowed, lim.blob_cells, lim.max_slots, shard, self.layout.shards)
            except ProtocolError as exc:
                raise ProtocolError(f"refused cells for shard {shard}: {exc}") from None
            blob_cells.append(vetted.cells)
            # What needs Redis state is checked there before anything is written: for a
            # blob with this region's slots, claims on its own current slot (every cell);
            # and, per shard, the registry with the slot ids of all the message's blobs
            # at once (merge.lua needs only the slot list for that), so that blobs that
            # each fit cannot fill the registry or pass the new-id cap together.
            if self._region_b in vetted.regions:
                checks.append((shard, blob))
                check_cells.append(vetted.cells)
            union = slot_ids.setdefault(shard, {})
            for slot_id in vetted.slots:
                union.setdefault(slot_id, None)
        for shard, ids in slot_ids.items():
            if len(ids) > lim.max_slots:
                raise ProtocolError(f"refused cells for shard {shard}: too many slot ids in one message")
            checks.append((shard, pack_blob(list(ids), (), (), ())))
            check_cells.append(0)
        for (shard, _), reply in zip(checks, checked_replies(await self._merge_trips(calls(b"0", checks), check_cells)),
                                     strict=True):
            if int(reply[0]) != 1:
                raise ProtocolError(f"refused cells for shard {shard}: {reply[1].decode(errors='replace')}")
        if admit is not None:
            await admit()
        out = MergeResult()
        # b"2": the blobs the b"0" calls accepted, so merge.lua skips the per-cell type checks.
        for (shard, _), reply in zip(blobs, checked_replies(await self._merge_trips(calls(b"2", blobs), blob_cells)),
                                     strict=True):
            if int(reply[0]) != 1:
                # Only a change since the checks (a concurrent merge filled the registry) can
                # refuse now, after other blobs were written: not the sender's fault, and
                # sending again (a max-merge) is safe, so not a refusal (4xx) but a retry.
                raise StorageError(f"cells for shard {shard} not merged (Redis changed since they were "
                                   f"checked: {reply[1].decode(errors='replace')}); send them again")
            out.add(reply)
            if len(reply) > 9 and int(reply[9]) >= 0:
                self.parked.note(shard, int(reply[9]))
            if len(reply) > 10:  # parking keys of another type (junk): deleted
                self.junk.note(shard, reply[10], "merge")
        return out

    async def _merge_trips(self, calls: list[list[bytes]], cells: list[int]) -> list[Any]:
        """merge.lua ``calls`` (``cells[i]`` cells in call i) in trips under the merge gate."""
        replies: list[Any] = []
        for start, end in merge_trips(cells):
            async with self._merge_gate:
                replies += await self.store.run_many(_MERGE, calls[start:end], end - start)
        return replies

    # -- whole-window reads (anti-entropy, the demo) ------------------------------

    async def read_live(
        self, now_us: int, partitions: set[int] | None = None
    ) -> dict[tuple[str, bytes], list[tuple[int, str, int, int]]]:
        """Every non-empty live cell by key, optionally only in some partitions."""
        client = self.store.client()
        keys: list[bytes] = []
        try:
            async for key in client.scan_iter(match=self.layout.data_pattern(), count=1000):
                keys.append(key)
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        wanted: list[tuple[int, str, bytes, bytes]] = []
        for key in keys:
            try:
                shard, rule, subject = self.layout.parse_data_key(key)
            except ValueError:
                continue
            if rule in self.rules and (partitions is None or partition_of(subject) in partitions):
                wanted.append((shard, rule, subject, key))
        shards = sorted({w[0] for w in wanted})
        registries = dict(zip(shards, await self._hgetall([self.layout.registry_key(s) for s in shards]), strict=True))
        out: dict[tuple[str, bytes], list[tuple[int, str, int, int]]] = {}
        for start in range(0, len(wanted), 1000):
            chunk = wanted[start : start + 1000]
            for (shard, rule_name, subject, _), fields in zip(chunk, await self._hgetall([w[3] for w in chunk]), strict=True):
                spec = self.rules[rule_name]
                low, high = live_range(spec, now_us)
                view = read_key(fields, bucket_of(now_us, spec.resolution_us), spec.buckets, spec.ring)
                names = slot_names(registries.get(shard, {}))
                cells = [
                    (bucket, names[slot], value, floor)
                    for (slot, bucket), (value, floor) in view.cells.items()
                    if low <= bucket <= high and slot in names and (value or floor)
                ]
                if cells:
                    out[(rule_name, subject)] = cells
        return out

    async def _hgetall(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        if not keys:
            return []
        client = self.store.client()
        try:
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return list(await pipe.execute())
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc


def new_incarnation(nonce: bytes) -> bytes:
    """A fresh incarnation id: microsecond time in hex plus this process's nonce."""
    micros = time.time_ns() // 1000
    return b"%x%05x" % (micros // 1_000_000, micros % 1_000_000) + nonce

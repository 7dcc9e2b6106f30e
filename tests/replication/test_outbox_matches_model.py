"""drain.lua + pack.lua + settle.lua against the pure model (hypothesis, real Redis).

The sender is region "r": an AsyncLimiter and a ReplicationStore on one real Redis,
with small script bounds so that drains, packs and keys are split across calls.
Its peers p1, p2 and p3 are pure models. A peer knows the cells it sent to r (those
r kept: merge.lua drops cells outside ``[c - N, c + F]``) and the join of every blob r
delivered to it: a batch counts as delivered when it is acknowledged; a nacked batch
(or one returned by ``recover``) was lost on the wire.

For any interleaving of hits (several rules at once), resets (floors), merges from
peers (far-past and far-future cells, old incarnations of peers and of r itself,
relayed to every peer but the source), clock moves of a few microseconds up to
several windows, partial drains, packs into in-flight slots (bounded in keys and
cells, shard subsets) and acks, nacks and recoveries (shard subsets):

* r's Redis holds the model's state (``ModelStore``: hit, reset, join);
* nothing is lost at any moment: every live cell of r that a peer lacks is covered by
  an entry queued for that peer (r's changed hash, the peer's outbox or one of its
  in-flight slots) whose bucket and scope (own slot only, or every slot) include it;
* once the outboxes are flushed, each peer's knowledge equals r's live state, and no
  changed, outbox or in-flight entry is left.

A second property, at one instant: after a pack that took a peer's whole outbox and
some writes, an ack leaves queued exactly the keys written since (for that peer),
and a nack exactly those plus the keys the pack sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.gcounter import Cell, join_cell
from geolimit.core.keys import KeyLayout
from geolimit.core.model import ModelStore
from geolimit.core.window import SUBSTEPS
from geolimit.replication.digest import live_range
from geolimit.replication.redis_io import MAX_WINDOW, Limits, ReplicationStore, blobs_from_cells
from geolimit.replication.wire import Blob
from tests.support.blobs import unblob
from tests.support.outboxes import Queued, queue_key_names, queued_entries

RULES = (
    Rule("api", 10**6, 10, 1, predict=False),  # N = 10, F = 2, M = 13
    Rule("min", 10**6, 60, 6, predict=False),  # N = 10, F = 1, M = 12
    Rule("slow", 10**6, 20, 1, predict=False),  # N = 20, F = 2, M = 23
)
BY_NAME = {r.name: r for r in RULES}
SHARDS = 4
# shards 0, 0, 2, 1, 3: two keys share shard 0
SUBJECTS = (b"s1", b"s3", b"s2", b"u:{x}", b"\x00bin")
PEERS = ("p1", "p2", "p3")
MERGE_SLOTS = ("p1/a", "p2/b", "p3/c", "p1/old", "r/old")  # r's old incarnation too
T0 = 1_700_000_000.5
LEASE_US = 10**12  # the manual clock may jump far: keep the lease (and change tracking) alive
SMALL = Limits(drain_keys=2, pack_keys=2, pack_cells=4)
WIDE = Limits(drain_keys=10_000, pack_keys=10_000, pack_cells=100_000)

CellKey = tuple[str, bytes, int, str]  # rule, subject, bucket, slot id
Known = dict[CellKey, tuple[int, int]]  # -> (value, floor)
DataKey = tuple[str, bytes]  # rule, subject


# -- operations ------------------------------------------------------------------

rule_ids = st.sampled_from((0, 0, 0, 1, 2))  # mostly "api": more cells per key
subjects = st.sampled_from(SUBJECTS[:3] * 2 + SUBJECTS[3:])  # mostly shards 0 and 2
rule_sets = st.lists(rule_ids, min_size=1, max_size=2, unique=True)
# (the clock moves before the hit: 0, within the bucket, or into the next bucket or two)
hits = st.tuples(st.just("hit"), rule_sets, subjects, st.integers(0, 3),
                 st.sampled_from((0, 0, 300_000, 1_000_000, 2_100_000)))
resets = st.tuples(st.just("reset"), rule_sets, subjects)
merge_cells = st.lists(
    st.tuples(
        rule_ids,
        subjects,
        st.integers(-24, 6),  # bucket offset from the current one: far past ... far future
        st.sampled_from(MERGE_SLOTS),
        st.one_of(st.integers(0, 2**12), st.just(2**53 - 1)),
        st.one_of(st.just(0), st.integers(0, 2**12)),
    ),
    min_size=1,
    max_size=12,
)
merges = st.tuples(st.just("merge"), st.sampled_from(range(len(PEERS))), merge_cells)


@st.composite
def fills(draw: st.DrawFn) -> tuple[Any, ...]:
    """A merge filling one key: every bucket from just before the window to just after the
    skew allowance, for one to three slots (large keys: packs split them)."""
    rule_id, subject = draw(rule_ids), draw(subjects)
    slots = draw(st.lists(st.sampled_from(MERGE_SLOTS), min_size=1, max_size=3, unique=True))
    base, floored = draw(st.integers(1, 2**10)), draw(st.booleans())
    rule = RULES[rule_id]
    cells = [
        (rule_id, subject, offset, slot, base + SUBSTEPS * k, base if floored and k % 3 == 0 else 0)
        for k, offset in enumerate(range(-rule.buckets - 1, rule.future + 2))
        for slot in slots
    ]
    return ("merge", draw(st.sampled_from(range(len(PEERS)))), cells)


advances = st.tuples(
    st.just("advance"),
    st.one_of(st.integers(0, 2_500_000), st.sampled_from([6_000_000, 30_000_000, 65_000_000, 400_000_000])),
)
drains = st.tuples(st.just("drain"))
shard_choice = st.one_of(st.none(), st.none(), st.integers(0, SHARDS - 1))  # None: every shard
packs = st.tuples(
    st.just("pack"), st.sampled_from(range(len(PEERS))), st.integers(0, 2), shard_choice,
    st.one_of(st.none(), st.integers(1, 4)),
)
settles = st.tuples(st.just("settle"), st.sampled_from(range(len(PEERS))), st.integers(0, 2), st.booleans(), shard_choice)
recovers = st.tuples(st.just("recover"))
operations = st.lists(
    st.one_of(hits, hits, merges, merges, fills(), resets, advances, drains, drains, packs, packs, packs, settles,
              settles, settles, recovers),
    max_size=50,
)
writes = st.lists(st.one_of(hits, resets, merges, fills()), max_size=10)


# -- the world: r's Redis, the model, what each peer knows --------------------------


@dataclass
class World:
    limiter: AsyncLimiter
    store: ReplicationStore
    clock: ManualClock
    model: ModelStore = field(default_factory=lambda: ModelStore("r"))
    own: str = ""
    accepted: dict[str, Known] = field(default_factory=lambda: {p: {} for p in PEERS})  # sent to r, kept by r
    received: dict[str, Known] = field(default_factory=lambda: {p: {} for p in PEERS})  # delivered by r
    flights: dict[tuple[str, int, int], list[Blob]] = field(default_factory=dict)  # (peer, slot, shard) -> blobs

    @property
    def layout(self) -> KeyLayout:
        return self.store.layout

    async def start(self) -> None:
        await self.store.store.client().flushdb()
        self.clock.set(T0)
        drained = await self.store.drain(LEASE_US)  # registries (one incarnation) and the lease
        slots = set(drained.own_slots.values())
        assert len(slots) == 1, slots
        self.own = slots.pop()
        self.model = ModelStore("r", self.own.partition("/")[2])
        self.accepted = {p: {} for p in PEERS}
        self.received = {p: {} for p in PEERS}
        self.flights = {}

    def knows(self, peer: str) -> Known:
        return join_known(self.accepted[peer], self.received[peer])

    def model_live(self) -> Known:
        now = self.clock.now_us()
        out: Known = {}
        for (rule, subject), state in self.model.keys.items():
            low, high = live_range(BY_NAME[rule], now)
            for bucket, slots in state.items():
                if low <= bucket <= high:
                    for slot, cell in slots.items():
                        if cell.value or cell.floor:
                            out[(rule, subject, bucket, slot)] = (cell.value, cell.floor)
        return out

    async def live(self) -> Known:
        found = await self.store.read_live(self.clock.now_us())
        return {(rule, subject, b, slot): (v, f) for (rule, subject), cells in found.items() for b, slot, v, f in cells}

    def _key_states(self) -> dict[DataKey, Any]:
        return {k: {b: dict(slots) for b, slots in v.items()} for k, v in self.model.keys.items()}

    def _changed(self, before: dict[DataKey, Any]) -> set[DataKey]:
        """Keys whose live state changed in the model since ``before``."""
        now = self.clock.now_us()
        out = set()
        for key, state in self.model.keys.items():
            low, high = live_range(BY_NAME[key[0]], now)
            old = before.get(key, {})

            def live(s: Any, low: int = low, high: int = high) -> dict[tuple[int, str], Cell]:
                return {(b, slot): c for b, slots in s.items() if low <= b <= high
                        for slot, c in slots.items() if c.value or c.floor}

            if live(state) != live(old):
                out.add(key)
        return out

    async def write(self, op: tuple[Any, ...]) -> dict[str, set[DataKey]]:
        """Apply a hit, reset or merge to Redis and the model; the keys it changed, per peer."""
        kind = op[0]
        if kind == "hit":
            self.clock.advance_us(op[4])
        now = self.clock.now_us()
        before = self._key_states()
        if kind == "hit":
            _, rule_ids, subject, cost, _ = op
            names = [RULES[i].name for i in rule_ids]
            await self.limiter.hit(names, subject, cost)  # huge merged values may deny: the model too
            self.model.hit([RULES[i] for i in rule_ids], subject, cost, now)
            changed = self._changed(before)
            return {p: set(changed) for p in PEERS}
        if kind == "reset":
            _, rule_ids, subject = op
            await self.limiter.reset([RULES[i].name for i in rule_ids], subject)
            self.model.reset([RULES[i] for i in rule_ids], subject, now)
            changed = self._changed(before)
            return {p: set(changed) for p in PEERS}
        assert kind == "merge"
        _, source_id, drawn = op
        source = PEERS[source_id]
        cells = []
        for rule_id, subject, offset, slot, value, floor in drawn:
            rule = RULES[rule_id]
            cells.append((rule.name, subject, now // rule.resolution_us + offset, slot, value, floor))
        await self.store.merge_blobs(blobs_from_cells(self.layout, cells), source, [p for p in PEERS if p != source])
        for rule_name, subject, bucket, slot, value, floor in cells:
            low, high = live_range(BY_NAME[rule_name], now)
            if low <= bucket <= high:  # what merge.lua keeps
                self.model.merge(rule_name, subject, {bucket: {slot: Cell(value, floor)}})
                absorb(self.accepted[source], [(rule_name, subject, bucket, slot, value, floor)])
        changed = self._changed(before)
        return {p: (set() if p == source else set(changed)) for p in PEERS}

    async def pack(self, peer: str, slot: int, shards: Sequence[int], max_cells: int | None = None) -> list[Blob]:
        packed = await self.store.pack(peer, slot, shards, max_cells)
        for shard, blob in packed.blobs:
            self.flights.setdefault((peer, slot, shard), []).append((shard, blob))
        assert packed.bad == 0
        assert packed.unknown == 0
        return packed.blobs

    async def settle(self, peer: str, slot: int, shards: Sequence[int], delivered: bool) -> None:
        await self.store.settle(peer, slot, shards, delivered)
        for shard in shards:
            blobs = self.flights.pop((peer, slot, shard), [])
            if delivered:
                absorb(self.received[peer], unblob(blobs))

    async def recover(self) -> None:
        await self.store.recover()
        self.flights.clear()  # every in-flight batch went back to the outboxes

    async def queued(self, kinds: str = "cof") -> Queued:
        """Per peer: every entry that will still be sent to it: changed hash (c), outbox (o), in flight (f)."""
        names = [n for n in queue_key_names(self.layout, PEERS, MAX_WINDOW) if n[1] in kinds]
        async with self.store.store.client().pipeline(transaction=False) as pipe:
            for _, _, name in names:
                pipe.hgetall(name)
            hashes = await pipe.execute()
        return queued_entries(self.layout, PEERS, names, hashes)

    async def drain_all(self) -> None:
        for _ in range(100):
            if not (await self.store.drain(LEASE_US)).changed_left:
                return
        raise AssertionError("the changed hashes never emptied")

    async def check_nothing_lost(self, where: str) -> None:
        live = await self.live()
        assert live == self.model_live(), f"{where}: r's Redis differs from the model"
        queued = await self.queued()
        for peer in PEERS:
            knows = self.knows(peer)
            for cell, (value, floor) in live.items():
                kv, kf = knows.get(cell, (0, 0))
                if value <= kv and floor <= kf:
                    continue
                rule, subject, bucket, slot = cell
                entries = queued[peer].get((rule, subject), [])
                assert any(b <= bucket and (wide or slot == self.own) for b, wide in entries), (
                    f"{where}: {peer} lacks {cell} = {(value, floor)} (it knows {(kv, kf)}) and nothing "
                    f"queued for it covers that cell; entries for the key: {entries}"
                )
            assert all(v <= live.get(c, (0, 0))[0] and f <= live.get(c, (0, 0))[1]
                       for c, (v, f) in restrict(self.received[peer], self.clock.now_us()).items()), (
                f"{where}: {peer} received more than r holds"
            )


def join_known(a: Known, b: Known) -> Known:
    out = dict(a)
    absorb(out, [(*cell, v, f) for cell, (v, f) in b.items()])
    return out


def absorb(known: Known, cells: Iterable[tuple[str, bytes, int, str, int, int]]) -> None:
    """Merge cells into a peer's knowledge: the G-counter join of each cell (gcounter.join_cell)."""
    for rule, subject, bucket, slot, value, floor in cells:
        have = Cell(*known.get((rule, subject, bucket, slot), (0, 0)))
        joined = join_cell(have, Cell(value, floor))
        known[(rule, subject, bucket, slot)] = (joined.value, joined.floor)


def restrict(known: Known, now_us: int) -> Known:
    """The live, non-empty cells of ``known`` at ``now_us``."""
    out: Known = {}
    for (rule, subject, bucket, slot), (v, f) in known.items():
        low, high = live_range(BY_NAME[rule], now_us)
        if low <= bucket <= high and (v or f):
            out[(rule, subject, bucket, slot)] = (v, f)
    return out


def shards_of(choice: int | None) -> list[int]:
    return list(range(SHARDS)) if choice is None else [choice]


@dataclass
class Sender:
    limiter: AsyncLimiter
    clock: ManualClock

    def world(self, limits: Limits) -> World:
        lim = self.limiter
        store = ReplicationStore(
            lim.store, lim.layout, "r", lim.rules, b"n0", now_us=self.clock.now_us, peers=PEERS, limits=limits
        )
        return World(lim, store, self.clock)


@pytest.fixture
async def sender(redis_url: str, redis_client: redis.Redis) -> AsyncIterator[Sender]:
    """Region r's limiter on the flushed shared Redis (another test's region there would be refused)."""
    clock = ManualClock(T0)
    lim = AsyncLimiter.from_url(redis_url, region="r", rules=RULES, clock=clock, shards=SHARDS)
    yield Sender(lim, clock)
    await lim.aclose()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, settle_in_flight=st.booleans())
async def test_every_peer_ends_with_the_senders_live_state_and_nothing_is_ever_lost(
    sender: Sender, ops: list[tuple[Any, ...]], settle_in_flight: bool
) -> None:
    w = sender.world(SMALL)
    await w.start()
    for i, op in enumerate(ops):
        kind = op[0]
        if kind in ("hit", "reset", "merge"):
            await w.write(op)
        elif kind == "advance":
            w.clock.advance_us(op[1])
        elif kind == "drain":
            await w.store.drain(LEASE_US)
        elif kind == "pack":
            _, peer_id, slot, shard, max_cells = op
            await w.pack(PEERS[peer_id], slot, shards_of(shard), max_cells)
        elif kind == "settle":
            _, peer_id, slot, delivered, shard = op
            await w.settle(PEERS[peer_id], slot, shards_of(shard), delivered)
        else:
            await w.recover()
        await w.check_nothing_lost(f"after op {i} {kind}")

    # Flush: what is in flight is acknowledged (or returned), then every outbox is sent.
    await w.drain_all()
    for peer, slot, shard in list(w.flights):
        await w.settle(peer, slot, [shard], settle_in_flight)
    for peer in PEERS:
        for _ in range(500):
            blobs = await w.pack(peer, 0, range(SHARDS), None)
            await w.settle(peer, 0, range(SHARDS), True)
            if not blobs and not sum((await w.store.drain(LEASE_US)).pending[peer].values()):
                break
        else:
            raise AssertionError(f"{peer}'s outbox never emptied")
    await w.check_nothing_lost("after the flush")
    live = await w.live()
    now = w.clock.now_us()
    for peer in PEERS:
        assert restrict(w.knows(peer), now) == live, f"{peer} does not hold r's live state"
    queued = await w.queued()
    assert all(not q for q in queued.values()), f"entries left after the flush: {queued}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    before=writes, after=writes, peer_id=st.sampled_from(range(len(PEERS))), slot=st.integers(0, MAX_WINDOW - 1),
    drain_between=st.booleans(), delivered=st.booleans(),
)
async def test_an_ack_removes_exactly_what_was_sent_and_a_nack_returns_it(
    sender: Sender, before: list[tuple[Any, ...]], after: list[tuple[Any, ...]], peer_id: int, slot: int,
    drain_between: bool, delivered: bool,
) -> None:
    w = sender.world(WIDE)
    await w.start()
    peer = PEERS[peer_id]
    for op in before:
        await w.write(op)
    await w.drain_all()
    lacking = {c for c, vf in (await w.live()).items() if vf != w.knows(peer).get(c)}
    blobs = await w.pack(peer, slot, range(SHARDS))
    assert not (await w.queued("co"))[peer], "one pack with wide bounds takes the whole outbox"
    sent = {(rule, subject) for rule, subject, *_ in unblob(blobs)}
    sent_cells = {(rule, subject, b, s) for rule, subject, b, s, _, _ in unblob(blobs)}
    assert lacking <= sent_cells, "the pack holds every cell the peer lacks"
    written: set[DataKey] = set()
    for op in after:
        written |= (await w.write(op))[peer]
    if drain_between:
        await w.drain_all()
    await w.settle(peer, slot, range(SHARDS), delivered)
    queued = set((await w.queued("co"))[peer])
    assert not (await w.queued("f"))[peer], "nothing left in flight"
    if delivered:
        assert queued == written, "an ack keeps exactly the keys written since the pack"
    else:
        assert queued == written | sent, "a nack returns every key that was sent"
    await w.check_nothing_lost("after the settle")

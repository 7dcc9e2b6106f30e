"""Anti-entropy tests' two regions: raw writes by slot id, a test max-merge, the exchange pair.

Two regions are two redis-servers; ``send`` calls the other side's ``handle``
directly (through msgpack, as the transport would). Repairs are applied by a
test-only max-merge (``Region.merge``), so these tests cover the exchange alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import pytest
import redis

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.core.window import SUBSTEPS, read_key
from geolimit.replication.antientropy import AntiEntropy, check_blob
from geolimit.replication.redis_io import unpack_blob
from geolimit.store.async_store import AsyncStore
from geolimit.store.connect import open_async_store
from geolimit.store.embedded import EmbeddedRedis

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 60, 6)  # N = 10, F = 1, M = 12
HOUR = Rule("hour", 10**9, 3600, 1)  # N = 3600, F = 2, M = 3603
RULES = {"api": API, "hour": HOUR}
NOW = time.time()
NOW_US = int(NOW * 1_000_000)
Cell = tuple[int, str, int, int]  # bucket, slot id, value, floor


def bucket(rule: Rule, back: int = 0) -> int:
    return NOW_US // rule.resolution_us - back


class Region:
    """One region's Redis: raw writes by slot id, live cells by slot id, a test max-merge."""

    def __init__(self, name: str, client: Any, store: AsyncStore, layout: KeyLayout) -> None:
        self.name = name
        self.client = client  # redis.Redis or redis.cluster.RedisCluster (sync)
        self.store = store
        self.layout = layout
        self.merged: list[tuple[str, int]] = []  # (peer, blobs) of every merge call

    def index(self, shard: int, slot: str) -> int:
        reg = self.layout.registry_key(shard)
        if not self.client.hexists(reg, "@"):
            self.client.hset(reg, mapping={"@": "i0", "#": 1, f"{self.name}/i0": 0})
        got = self.client.hget(reg, slot)
        if got is None:
            got = self.client.hincrby(reg, "#", 1) - 1
            self.client.hset(reg, slot, got)
        return int(got)

    def put(self, rule: Rule, subject: bytes, cells: Iterable[Cell], head: int | None = None) -> None:
        """Write cells as they are (no merge), the head at the newest bucket unless given."""
        cells = list(cells)
        shard = self.layout.shard_of(subject)
        key = self.layout.data_key(rule.name, subject)
        fields: dict[str, int] = {"h": head if head is not None else max(c[0] for c in cells)}
        for b, slot, value, floor in cells:
            f = self.index(shard, slot) * rule.ring + b % rule.ring
            if value:
                fields[str(f)] = value
            if floor:
                fields[str(-f - 1)] = floor
        self.client.delete(key)
        for start in range(0, len(fields), 5000):
            chunk = dict(list(fields.items())[start : start + 5000])
            self.client.hset(key, mapping=chunk)

    def cells(self, rule: Rule, subject: bytes) -> dict[tuple[str, int], tuple[int, int]]:
        """Live non-zero cells by (slot id, bucket)."""
        shard = self.layout.shard_of(subject)
        registry = self.client.hgetall(self.layout.registry_key(shard))
        names = {int(v): k.decode() for k, v in registry.items() if b"/" in k}
        raw = self.client.hgetall(self.layout.data_key(rule.name, subject))
        view = read_key(raw, NOW_US // rule.resolution_us, rule.buckets, rule.ring)
        low, high = bucket(rule, rule.buckets), bucket(rule) + rule.future
        return {
            (names[s], b): cell
            for (s, b), cell in view.cells.items()
            if cell != (0, 0) and s in names and low <= b <= high
        }

    def snapshot(self) -> dict[bytes, Any]:
        out: dict[bytes, Any] = {}
        for key in self.client.scan_iter(count=1000):
            kind = self.client.type(key)
            out[key] = self.client.hgetall(key) if kind == b"hash" else self.client.dump(key)
        return out

    async def merge(self, peer: str, blobs: list[tuple[int, bytes]], admit: Any = None) -> None:
        """Test-only max-merge of blobs (the agent's merge_blobs does this in Lua)."""
        if admit is not None:
            await admit()
        self.merged.append((peer, len(blobs)))
        for shard, blob in blobs:
            check_blob(blob, shard, self.layout, RULES)
            raw_slots, keys = unpack_blob(blob)
            slots = [s.decode() for s in raw_slots]
            for suffix, flat in keys:
                rule = RULES[suffix.partition(b":")[0].decode()]
                key = self.layout.tag(shard) + b":" + suffix
                raw = self.client.hgetall(key)
                head = int(raw[b"h"]) if b"h" in raw else None
                top = max(flat[0::4])
                if head is None or top > head:
                    if head is not None and top - head >= rule.ring:
                        self.client.delete(key)
                        raw = {}
                    elif head is not None:
                        passed = {b % rule.ring for b in range(head + 1, top + 1)}
                        stale = [f for f in raw if f not in (b"h", b"e") and _base(f) % rule.ring in passed]
                        if stale:
                            self.client.hdel(key, *stale)
                            for f in stale:
                                del raw[f]
                    head = top
                writes: dict[bytes, int] = {b"h": head}
                for j in range(0, len(flat), 4):
                    b, ref, value, floor = flat[j : j + 4]
                    if b <= head - rule.ring:
                        continue
                    f = self.index(shard, slots[ref]) * rule.ring + b % rule.ring
                    for name, new in ((b"%d" % f, value), (b"%d" % (-f - 1), floor)):
                        if new > max(int(raw.get(name, 0)), writes.get(name, 0)):
                            writes[name] = new
                self.client.hset(key, mapping=writes)


def _base(field: bytes) -> int:
    f = int(field)
    return -f - 1 if f < 0 else f


def pair(a: Region, b: Region, rules: dict[str, Rule] | None = None, **options: Any) -> dict[str, AntiEntropy]:
    """Both sides' AntiEntropy, each sending to the other through msgpack."""
    sides: dict[str, AntiEntropy] = {}
    regions = {a.name: a, b.name: b}

    def sender(me: str) -> Callable[[str, dict[str, Any]], Any]:
        async def send(peer: str, payload: dict[str, Any]) -> dict[str, Any]:
            wire = msgpack.unpackb(msgpack.packb(payload, use_bin_type=True), raw=False)
            reply = await sides[peer].handle(me, wire)
            return msgpack.unpackb(msgpack.packb(reply, use_bin_type=True), raw=False)  # type: ignore[no-any-return]

        return send

    for name, region in regions.items():
        sides[name] = AntiEntropy(
            name, region.store, region.layout, rules or RULES, sender(name), region.merge,
            clock=lambda: NOW, **options,
        )
    return sides


@pytest.fixture(scope="module")
def servers(redis_server_factory: Factory) -> tuple[EmbeddedRedis, EmbeddedRedis]:
    return redis_server_factory(), redis_server_factory()


@pytest.fixture
async def regions(servers: tuple[EmbeddedRedis, EmbeddedRedis]) -> Any:
    made: list[Region] = []
    for name, server in zip("ab", servers, strict=True):
        client = redis.Redis.from_url(server.url)
        client.flushall()
        made.append(Region(name, client, open_async_store(server.url, timeout=5.0), KeyLayout("gl", 16)))
    yield made[0], made[1]
    for region in made:
        await region.store.close()
        region.client.close()


def subjects(n: int) -> list[bytes]:
    return [b"user:%d" % i for i in range(n)]


def typical(i: int) -> list[Cell]:
    """A key with cells of three regions in a few buckets (and a floor)."""
    c = bucket(API)
    cells: list[Cell] = [
        (c, "a/i0", SUBSTEPS * (i + 1) + 3, 0),
        (c - 1, "a/i0", SUBSTEPS * (i % 7 + 1), SUBSTEPS if i % 5 == 0 else 0),
        (c - 2, "b/i0", SUBSTEPS * (i % 11 + 2), 0),
        (c - 4, "c/i9", 2**52 + i, 0),  # near the top of the range
    ]
    return cells


def assert_equal(a: Region, b: Region, rule: Rule, keys: Iterable[bytes]) -> None:
    for subject in keys:
        assert a.cells(rule, subject) == b.cells(rule, subject), subject


def first_passes(sides: dict[str, AntiEntropy], first: str) -> dict[str, AntiEntropy]:
    """How each side's first digest pass goes: "leaves" (a small keyspace: shards and
    leaves at once), "shards" (a big one: shard sums first, then the leaves of the
    shards that differ), "mixed" (a: shards first, b: leaves at once)."""
    for name, side in sides.items():
        side._local.shards_first_keys = 0 if first == "shards" or (first == "mixed" and name == "a") else None
    return sides

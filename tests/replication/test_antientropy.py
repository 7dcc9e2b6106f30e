"""Anti-entropy (geolimit.replication.antientropy) against real Redis servers.

Two regions are two redis-servers; ``send`` calls the other side's ``handle``
directly (through msgpack, as the transport would). Repairs are applied by a
test-only max-merge (``Region.merge``), so these tests cover the exchange alone;
tests/replication/test_repair_in_agents.py covers it with the agent's merge.
"""

from __future__ import annotations

import time

import pytest
import redis
import redis.cluster

from geolimit.core.keys import KeyLayout
from geolimit.core.rule import Rule
from geolimit.core.window import SUBSTEPS
from geolimit.replication.antientropy import (
    MAX_BLOB_CELLS,
    AntiEntropyResult,
    digest_of_cells,
    key_seed,
)
from geolimit.replication.antientropy import local as ae_local
from geolimit.replication.antientropy.common import _Plan, leaves_per_shard
from geolimit.replication.antientropy.local import _Local
from geolimit.replication.antientropy.scan import _Progress
from geolimit.store.connect import open_async_store
from geolimit.store.embedded import EmbeddedRedis
from tests.replication.antientropy_support import (
    API,
    HOUR,
    NOW_US,
    RULES,
    Region,
    assert_equal,
    bucket,
    first_passes,
    pair,
    regions,
    servers,
    subjects,
    typical,
)

__all__ = ["regions", "servers"]  # fixtures


async def test_identical_regions_exchange_no_keys(regions: tuple[Region, Region]) -> None:
    a, b = regions
    keys = subjects(300)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
    # b: the same cells, slot indices allocated in another order (not the same in
    # every shard), fields in another order
    for shard in range(0, 16, 2):
        b.index(shard, "z/i1")
    for s in keys:
        b.index(b.layout.shard_of(s), "c/i9")
    for i, s in reversed(list(enumerate(keys))):
        b.put(API, s, list(reversed(typical(i))))
    assert a.cells(API, keys[0]) == b.cells(API, keys[0])
    sides = pair(a, b)
    result = await sides["a"].run("b")
    assert result.in_sync
    assert result.keys_scanned == 300
    assert (result.keys_sent, result.keys_received, result.keys_listed) == (0, 0, 0)
    assert result.ranges_compared == 16  # one digest per shard
    assert not a.merged
    assert not b.merged


async def test_prediction_fields_are_not_compared(regions: tuple[Region, Region]) -> None:
    """The rise fields prediction keeps per key and peer slot ('p<slot>', written by
    merge.lua for deltas) differ between regions by design: the digests skip them,
    and regions with the same cells are in sync."""
    a, b = regions
    keys = subjects(50)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
        b.put(API, s, typical(i))
        key = b.layout.data_key(API.name, s)
        b.client.hset(key, mapping={"p1": f"{NOW_US}:{i + 1}:100000", "p2": f"{NOW_US - 5}:3:250000"})
    result = await pair(a, b)["a"].run("b")
    assert result.in_sync
    assert (result.keys_sent, result.keys_received, result.keys_listed) == (0, 0, 0)
    assert not a.merged
    assert not b.merged


@pytest.mark.parametrize("first", ["leaves", "shards", "mixed"])
async def test_missing_and_lower_cells_are_repaired_both_ways(regions: tuple[Region, Region], first: str) -> None:
    a, b = regions
    keys = subjects(400)
    c = bucket(API)
    for i, s in enumerate(keys):
        cells = typical(i)
        a.put(API, s, cells)
        kind = i % 8
        if kind == 0:
            continue  # b lacks the key
        if kind == 1:
            cells = cells[1:]  # b lacks a cell
        elif kind == 2:
            cells = [(cb, slot, v - SUBSTEPS if cb == c else v, f) for cb, slot, v, f in cells]  # b is lower
        elif kind == 3:
            cells = [*cells, (c - 3, "b/i0", 10 * SUBSTEPS, SUBSTEPS)]  # b has more (a cell a lacks)
        elif kind == 4:
            cells = [(cb, slot, v, f + SUBSTEPS if cb == c - 2 else f) for cb, slot, v, f in cells]  # b: higher floor
        b.put(API, s, cells)
    b.put(API, b"only-in-b", [(c, "b/i0", 2 * SUBSTEPS, 0)])
    sides = first_passes(pair(a, b), first)
    one = await sides["a"].run("b")
    assert one.leaves_differing > 0
    assert not one.truncated
    assert one.keys_differing == 5 * 50 + 1
    # differing keys travel both ways (a max-merge keeps what each side has more of)
    assert one.keys_received == 4 * 50 + 1
    assert one.keys_sent == 5 * 50
    assert_equal(a, b, API, [*keys, b"only-in-b"])
    second = await sides["a"].run("b")
    assert second.in_sync
    # the responder can start it too
    assert (await sides["b"].run("a")).in_sync


@pytest.mark.parametrize("first", ["shards", "mixed"])
async def test_differences_in_a_few_shards_are_found_after_a_shards_only_pass(
    regions: tuple[Region, Region], first: str
) -> None:
    """A big keyspace's first pass sums shards only; the leaves of the shards that
    differ are digested in a second pass, on both sides, and only those."""
    a, b = regions
    keys = subjects(300)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
        b.put(API, s, typical(i))
    lost = [s for s in keys if a.layout.shard_of(s) in (1, 5)][:12]
    assert lost
    for s in lost:  # b lost these keys' latest cells
        b.put(API, s, [cell for cell in typical(keys.index(s)) if cell[0] != bucket(API)])
    sides = first_passes(pair(a, b), first)
    result = await sides["a"].run("b")
    assert result.keys_differing == len(lost)
    assert result.ranges_differing >= 2
    assert_equal(a, b, API, keys)
    assert (await sides["b"].run("a")).in_sync


async def test_a_settled_exchange_leaves_recent_buckets_to_the_deltas(regions: tuple[Region, Region]) -> None:
    """A periodic exchange (``settle``) compares only buckets that ended ``settle`` ago:
    under load, cells still in deltas are not differences (they would fill every
    listing); an exchange something asked for compares everything."""
    a, b = regions
    c = bucket(API)
    recent, settled = subjects(40), [b"old:%d" % i for i in range(30)]
    for s in recent:  # b has not yet got a's latest cell: the current bucket differs
        a.put(API, s, [(c, "a/i0", 5 * SUBSTEPS, 0), (c - 4, "a/i0", SUBSTEPS, 0)])
        b.put(API, s, [(c, "a/i0", 4 * SUBSTEPS, 0), (c - 4, "a/i0", SUBSTEPS, 0)])
    for s in settled:  # a cell of a bucket that ended long ago was lost
        a.put(API, s, [(c - 4, "a/i0", 2 * SUBSTEPS, 0)])
        b.put(API, s, [(c - 4, "a/i0", SUBSTEPS, 0)])
    sides = pair(a, b)
    periodic = await sides["a"].run("b", settle=10.0)
    assert periodic.keys_differing == len(settled)
    assert_equal(a, b, API, settled)
    assert all(a.cells(API, s) != b.cells(API, s) for s in recent)
    assert (await sides["a"].run("b", settle=10.0)).in_sync
    full = await sides["a"].run("b")
    assert full.keys_differing == len(recent)
    assert_equal(a, b, API, recent)


@pytest.mark.parametrize("initiator", ["a", "b"])
async def test_a_wiped_region_gets_everything_back(regions: tuple[Region, Region], initiator: str) -> None:
    a, b = regions
    keys = subjects(250)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
    sides = pair(a, b)
    result = await sides[initiator].run("b" if initiator == "a" else "a")
    assert result.keys_differing == 250
    assert_equal(a, b, API, keys)
    assert (await sides["b"].run("a")).in_sync


async def test_a_key_of_3600_buckets_and_3_slots_is_repaired(regions: tuple[Region, Region]) -> None:
    a, b = regions
    c = bucket(HOUR)
    full = [(c - d, slot, SUBSTEPS * (d % 50 + 1) + k, 0) for d in range(3600) for k, slot in enumerate(("a/i0", "b/i0", "c/i9"))]
    a.put(HOUR, b"big", full)
    # b holds slot b/i0 only, a few of its cells higher than a's
    b.put(HOUR, b"big", [(cb, s, v + SUBSTEPS if cb % 97 == 0 else v, f) for cb, s, v, f in full if s == "b/i0"])
    a.put(API, b"small", typical(1))
    b.put(API, b"small", typical(1))
    sides = pair(a, b)
    result = await sides["a"].run("b")
    assert result.keys_differing == 1
    assert result.cells_sent == len(full)
    assert result.blobs_sent >= len(full) // MAX_BLOB_CELLS
    assert result.cells_received == 3600  # all of b's cells of the key
    assert len(a.cells(HOUR, b"big")) == len(full)
    assert_equal(a, b, HOUR, [b"big"])
    assert (await sides["b"].run("a")).in_sync


async def test_digests_match_the_python_reference(regions: tuple[Region, Region]) -> None:
    """What ae_scan.lua and ae_key.lua compute is the documented function (cell_sums, key_digest)."""
    a, _ = regions
    c = bucket(API)
    odd = [(c, "a/i0", 2**53 - 1, 2**53 - 2), (c - 10, "b/i0", 1, 0), (c - 5, "a/i0", SUBSTEPS, 0)]
    a.put(API, b"odd \x00{}:key", [*odd, (c - 11, "b/i0", 999, 0)], head=c)  # c - 11: out of the window
    ahead = [(c + 1, "c/i9", 0, SUBSTEPS), (c - 3, "a/i0", 2 * SUBSTEPS, 0)]
    a.put(API, b"ahead", ahead)
    c_hour = bucket(HOUR)
    big = [(c_hour - d, slot, 1000 + d, d % 3) for d in range(0, 3600, 7) for slot in ("a/i0", "b/i0")]
    a.put(HOUR, b"big", big)
    local = _Local(a.store, a.layout, 64)
    plan = _Plan(NOW_US, dict(RULES), 8, 16)
    digests = await local.digests(plan, _Progress())
    await digests.reduce()
    assert digests.keys == 3
    expected: dict[int, tuple[int, int]] = {}
    for rule, subject, cells in ((API, b"odd \x00{}:key", odd), (API, b"ahead", ahead), (HOUR, b"big", big)):
        suffix = rule.name.encode() + b":" + subject
        g = a.layout.shard_of(subject) * 8 + key_seed(suffix, 8)[0]
        d, n = expected.get(g, (0, 0))
        expected[g] = ((d + digest_of_cells(suffix, [(bk, s.encode(), v, f) for bk, s, v, f in cells])) % 2**52, n + 1)
    got = {g: (d, digests.counts[g]) for g, d in enumerate(digests.digests) if digests.counts[g]}
    assert got == expected
    by_shard = {g // 8: (0, 0) for g in expected}
    for g, (d, n) in expected.items():
        by_shard[g // 8] = ((by_shard[g // 8][0] + d) % 2**52, by_shard[g // 8][1] + n)
    assert {s: (digests.shard_digests[s], digests.shard_counts[s]) for s in by_shard} == by_shard


async def test_the_listing_is_bounded_and_later_runs_finish_the_repair(regions: tuple[Region, Region]) -> None:
    a, b = regions
    keys = subjects(600)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
    sides = pair(a, b, max_keys=100)
    runs: list[AntiEntropyResult] = []
    for _ in range(12):
        runs.append(await sides["a"].run("b"))
        if runs[-1].in_sync:
            break
    assert runs[0].truncated
    assert runs[0].keys_differing <= 100 + 10
    assert runs[-1].in_sync
    assert len(runs) <= 10
    assert_equal(a, b, API, keys)


async def test_paced_small_pages_and_two_streams_still_repair(regions: tuple[Region, Region]) -> None:
    a, b = regions
    keys = subjects(300)
    for i, s in enumerate(keys):
        a.put(API, s, typical(i))
        if i % 4:
            b.put(API, s, typical(i)[: i % 4])
    sides = pair(a, b, page_keys=16, page_ms=0.2, duty=0.5, streams=2)
    started = time.monotonic()
    first = await sides["a"].run("b")
    assert first.keys_differing == 300
    assert_equal(a, b, API, keys)
    assert (await sides["b"].run("a")).in_sync
    assert time.monotonic() - started < 30


async def test_pages_are_bounded(regions: tuple[Region, Region]) -> None:
    """Every scan call reads at most page_keys keys (plus one SCAN batch)."""
    a, _ = regions
    for i, s in enumerate(subjects(500)):
        a.put(API, s, typical(i))
    a.client.config_resetstat()
    local = _Local(a.store, a.layout, 10)
    digests = await local.digests(_Plan(NOW_US, dict(RULES), 8, 16), _Progress())
    assert digests.keys == 500
    calls = int(a.client.info("commandstats")["cmdstat_evalsha"]["calls"])
    assert calls >= 500 // (10 + 40)


async def test_scan_streams_split_the_keyspace_exactly(
    regions: tuple[Region, Region], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = regions
    fill = a.client.register_script(
        "for i = 2, #ARGV do redis.call('HSET', ARGV[i], 'h', ARGV[1], ARGV[1] % 12, 64 + i) end"
    )
    names = [a.layout.data_key("api", s) for s in subjects(40_000)]
    for shard in range(16):
        a.index(shard, "a/i0")
    for start in range(0, len(names), 5000):
        fill(args=[bucket(API), *names[start : start + 5000]])
    plan = _Plan(NOW_US, dict(RULES), 64, 16)
    one = await _Local(a.store, a.layout, 256, streams=1).digests(plan, _Progress())
    four = await _Local(a.store, a.layout, 256, streams=4).digests(plan, _Progress())
    assert one.keys == four.keys == 40_000
    assert one.shard_digests == four.shard_digests
    await one.reduce()
    await four.reduce()
    monkeypatch.setattr(ae_local, "PENDING_NUMBERS", 1000)  # leaves added during the pass
    small = await _Local(a.store, a.layout, 256, streams=2).digests(plan, _Progress())
    assert len(small.pending) < 2000
    await small.reduce()
    assert small.digests == one.digests
    assert one.digests == four.digests
    assert one.counts == four.counts


async def test_rules_and_prefixes_may_differ(servers: tuple[EmbeddedRedis, EmbeddedRedis]) -> None:
    """Only rules both sides share (same window and resolution) are compared; prefixes may differ."""
    made = []
    for name, server, prefix in (("a", servers[0], "gl"), ("b", servers[1], "other")):
        client = redis.Redis.from_url(server.url)
        client.flushall()
        made.append(Region(name, client, open_async_store(server.url), KeyLayout(prefix, 16)))
    a, b = made
    try:
        for i, s in enumerate(subjects(50)):
            a.put(API, s, typical(i))
            a.put(HOUR, s, [(bucket(HOUR), "a/i0", SUBSTEPS, 0)])
        b_rules = {"api": API, "hour": Rule("hour", 10, 3600, 60)}  # another resolution
        sides = pair(a, b)
        sides["b"].set_rules(b_rules)
        result = await sides["a"].run("b")
        assert result.rules == ["api"]
        assert_equal(a, b, API, subjects(50))
        assert b.client.keys(b"other:*hour*") == []
    finally:
        for region in made:
            await region.store.close()


def test_leaves_per_shard_is_a_power_of_two() -> None:
    assert leaves_per_shard(64) == 4096
    assert leaves_per_shard(16384) == 16
    assert leaves_per_shard(1) == 1 << 16
    assert leaves_per_shard(100) == 2048


@pytest.fixture
def cluster_region(redis_cluster_url: str, cluster_client: redis.cluster.RedisCluster) -> Region:
    return Region("a", cluster_client, open_async_store(redis_cluster_url, timeout=5.0), KeyLayout("gl", 16))


@pytest.mark.cluster
async def test_a_cluster_region_with_a_single_server_region(
    cluster_region: Region, servers: tuple[EmbeddedRedis, EmbeddedRedis]
) -> None:
    a = cluster_region
    client = redis.Redis.from_url(servers[1].url)
    client.flushall()
    b = Region("b", client, open_async_store(servers[1].url), KeyLayout("gl", 16))
    try:
        keys = subjects(200)
        for i, s in enumerate(keys):
            a.put(API, s, typical(i))
            if i % 3:
                b.put(API, s, typical(i)[: 1 + i % 3])
        c_hour = bucket(HOUR)
        a.put(HOUR, b"big", [(c_hour - d, "b/i0", SUBSTEPS + d, 0) for d in range(0, 3600, 2)])
        sides = pair(a, b)
        first = await sides["a"].run("b")
        assert first.keys_scanned == 201
        assert first.keys_differing > 100
        assert_equal(a, b, API, keys)
        assert_equal(a, b, HOUR, [b"big"])
        assert (await sides["b"].run("a")).in_sync
        assert (await sides["a"].run("b")).in_sync
    finally:
        await a.store.close()
        await b.store.close()

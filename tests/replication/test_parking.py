"""Cells further ahead than the clock-skew tolerance are kept and count once their bucket comes.

A region whose clock runs ahead (before the regions agreed on one clock, or beyond
what the agreed clock corrects) sends cells of buckets the receiver has not reached.
Within the tolerance (2 s) they count at once; further ahead, and at most
``park_seconds`` past it, the receiver parks them and merges them when their
bucket comes within the tolerance, instead of dropping them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.errors import StorageError
from geolimit.replication import wire
from geolimit.replication.auth import Signer
from geolimit.replication.redis_io import blobs_from_cells
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)  # 1 s buckets: a tolerance of 2 buckets


async def _merge(rs: Regions, cells: list[tuple[int, str, int]], subject: bytes = b"s") -> dict[str, object]:
    """POST (bucket, slot, count) cells to region b, signed as region a; b's status after."""
    six = [("api", subject, bucket, slot, count * SUBSTEPS, 0) for bucket, slot, count in cells]
    message = wire.Message(kind="delta", sender="a", dest="b", rules={"api": API.structure}, shards=64,
                           blobs=blobs_from_cells(KeyLayout(), six))
    body = wire.encode(message)
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    clock.advance(0.001)  # a new sequence number (the signer's is its clock in µs)
    headers = Signer(rs.secret, "a", clock).headers(body, "b")
    async with aiohttp.ClientSession() as http:
        async with http.post(rs.urls["b"] + "/v1/gossip", data=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(rs.urls["b"] + "/metrics") as resp:
            metrics = await resp.text()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
            if line.startswith("geolimit_gossip_cells_")}


async def test_a_cell_beyond_the_tolerance_counts_once_its_bucket_comes(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        await rs.step(names=["b"])
        app = rs["b"].app()
        c0 = clock.now_us() // API.resolution_us
        metrics = await _merge(rs, [(c0 + 5, "a/x", 7), (c0 + 1, "a/x", 2)])
        assert metrics["geolimit_gossip_cells_parked_total"] == 1
        assert metrics.get('geolimit_gossip_cells_dropped_total{reason="future"}', 0) == 0
        clock.advance(2 * API.resolution)
        assert app.usage("api", "s").total == 2  # the one within the tolerance counts; the parked one not yet
        await rs.step(names=["b"])  # c0 + 2(.1): bucket c0 + 5 is not within the tolerance yet
        clock.advance(1 * API.resolution)
        assert app.usage("api", "s").total == 2
        await rs.step(names=["b"])  # c0 + 3(.2): it is now: merged
        clock.advance(2 * API.resolution)  # c0 + 5(.2): its bucket is the current one
        assert app.usage("api", "s").total == 9
        assert app.usage("api", "s").by_slot == {"a/x": 9}


async def test_cells_too_far_ahead_or_over_the_cap_are_dropped_and_counted(redis_server_factory: Factory) -> None:
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        await rs.step(names=["b"])
        c0 = clock.now_us() // API.resolution_us
        metrics = await _merge(rs, [(c0 + 2 + 60, "a/x", 1), (c0 + 2 + 61, "a/x", 1)])
        assert metrics["geolimit_gossip_cells_parked_total"] == 1  # 60 s past the tolerance: kept
        assert metrics['geolimit_gossip_cells_dropped_total{reason="future"}'] == 1  # 61 s: dropped
        # The park holds at most park_cells per shard: a peer cannot fill Redis with future cells.
        store = rs["b"].agent.engine.store  # type: ignore[union-attr]
        cap = store.limits.park_cells
        layout = KeyLayout()
        tag = layout.registry_key(layout.shard_of(b"s"))[:-2]
        client = rs["b"].server.client()
        client.hset(tag + b"#pk", mapping={b"filler%d" % i: b"1:0" for i in range(cap - 2)})  # 1 parked + fillers
        metrics = await _merge(rs, [(c0 + 10, "a/x", 1), (c0 + 11, "a/x", 1)])
        assert metrics["geolimit_gossip_cells_parked_total"] == 2  # room for one more
        assert metrics['geolimit_gossip_cells_dropped_total{reason="future"}'] == 2
        assert client.hlen(tag + b"#pk") == cap


async def test_a_parked_cell_is_relayed_once_due_to_a_peer_its_sender_cannot_reach(
    redis_server_factory: Factory,
) -> None:
    """a's message says it reaches no peer (it names no reach), so what b merges from it
    goes on to c; a cell b parked goes on to c too, once it is due (not only through a
    later anti-entropy exchange)."""
    async with Regions(redis_server_factory, ["a", "b", "c"], [API], run_loops=False) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        await rs.step(names=["b", "c"])
        c0 = clock.now_us() // API.resolution_us
        metrics = await _merge(rs, [(c0 + 5, "a/x", 7)])
        assert metrics["geolimit_gossip_cells_parked_total"] == 1
        await rs.step(names=["b"])
        assert rs["c"].app().usage("api", "s").by_slot == {}
        clock.advance(3 * API.resolution)  # c0 + 3(.2): the parked bucket is within the tolerance
        await rs.step(2, names=["b"])  # unparked and merged, then sent on to c
        clock.advance(2 * API.resolution)  # its bucket is the current one
        assert rs["b"].app().usage("api", "s").by_slot == {"a/x": 7}
        assert rs["c"].app().usage("api", "s").by_slot == {"a/x": 7}


async def test_a_parked_blob_whose_merge_fails_once_is_merged_and_the_others_too(
    redis_server_factory: Factory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """unpark.lua takes due cells out of parking before they are merged: a merge that fails
    (the registry changed since its checks, Redis briefly away) must not lose them, nor
    the other shards' cells due in the same round. Before, the first StorageError ended
    the release and every cell it had taken out waited for anti-entropy."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False) as rs:
        clock = rs.clock
        assert isinstance(clock, ManualClock)
        await rs.step(names=["b"])
        layout = KeyLayout()
        subjects = [b"s", *(b"t%d" % i for i in range(64) if layout.shard_of(b"t%d" % i) != layout.shard_of(b"s"))][:2]
        c0 = clock.now_us() // API.resolution_us
        for subject in subjects:
            await _merge(rs, [(c0 + 5, "a/x", 7)], subject)
        engine = rs["b"].agent.engine
        assert engine is not None
        merge_blobs, failed = engine.store.merge_blobs, []

        async def failing_once(*args: Any, **kwargs: Any) -> Any:
            if not failed:
                failed.append(True)
                raise StorageError("cells for shard 1 not merged (Redis changed since they were checked)")
            return await merge_blobs(*args, **kwargs)

        monkeypatch.setattr(engine.store, "merge_blobs", failing_once)
        clock.advance(3 * API.resolution)
        await rs.step(names=["b"])
        clock.advance(2 * API.resolution)
        assert failed
        for subject in subjects:
            assert rs["b"].app().usage("api", subject.decode()).by_slot == {"a/x": 7}, subject

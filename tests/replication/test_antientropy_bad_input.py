"""Anti-entropy against bad input: hostile steps and replies are refused and write nothing.

See antientropy_support.py for the two regions (real redis-servers) and the pair.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from geolimit.core.window import SUBSTEPS
from geolimit.errors import ProtocolError
from geolimit.replication.antientropy import MAX_BLOB_CELLS
from tests.replication.antientropy_support import (
    API,
    NOW_US,
    Region,
    bucket,
    first_passes,
    pair,
    regions,
    servers,
    subjects,
    typical,
)

__all__ = ["regions", "servers"]  # fixtures


async def test_hostile_payloads_are_refused_and_write_nothing(regions: tuple[Region, Region]) -> None:
    a, b = regions
    for i, s in enumerate(subjects(40)):
        a.put(API, s, typical(i))
        b.put(API, s, typical(i)[:2])
    sides = pair(a, b)
    server = sides["b"]
    before = b.snapshot()
    good_begin = {"op": "begin", "x": b"x" * 16, "now": NOW_US, "shards": 16, "leaves": 8,
                  "rules": [["api", API.window_us, API.resolution_us]]}
    assert (await server.handle("a", dict(good_begin)))["rules"] == ["api"]

    def blob(obj: Any, bin_type: bool = False) -> bytes:
        return msgpack.packb(obj, use_bin_type=bin_type)  # type: ignore[no-any-return]

    subject = b"user:1"
    shard = b.layout.shard_of(subject)
    other = (shard + 1) % 16
    c = bucket(API)
    ok_cells = [c, 0, SUBSTEPS, 0]
    bad_requests: list[Any] = [
        "not a map",
        {"op": "nope", "x": b"x" * 16},
        {"op": "tree", "x": b"y" * 16, "level": 0, "nodes": [0]},  # unknown exchange
        {**good_begin, "x": b"short"},
        {**good_begin, "x": b"z" * 16, "shards": 64},
        {**good_begin, "x": b"z" * 16, "leaves": 3},
        {**good_begin, "x": b"z" * 16, "leaves": 1 << 20},
        {**good_begin, "x": b"z" * 16, "now": NOW_US + 10**9},
        {**good_begin, "x": b"z" * 16, "now": "soon"},
        {**good_begin, "x": b"z" * 16, "rules": [["api", "60s", 1]]},
        {**good_begin, "x": b"z" * 16, "rules": [[1, 2, 3]] * 2000},
        {"op": "tree", "x": b"x" * 16, "level": 9, "nodes": [0]},
        {"op": "tree", "x": b"x" * 16, "level": 0, "nodes": [16]},
        {"op": "tree", "x": b"x" * 16, "level": 0, "nodes": [-1]},
        {"op": "tree", "x": b"x" * 16, "level": 0, "nodes": list(range(5000))},
        {"op": "tree", "x": b"x" * 16, "level": 0, "nodes": [True]},
        {"op": "list", "x": b"x" * 16, "leaves": b"\xff" * 3},
        {"op": "entries", "x": b"x" * 16, "from": 0},  # before a listing
        {"op": "read", "x": b"x" * 16, "keys": [[other, b"api:" + subject]], "pos": 0},
        {"op": "read", "x": b"x" * 16, "keys": [[shard, b"hour:" + subject]], "pos": 0},
        {"op": "read", "x": b"x" * 16, "keys": [[shard, b"api" + subject]], "pos": 0},
        {"op": "read", "x": b"x" * 16, "keys": [[shard, b"api:" + b"x" * 5000]], "pos": 0},
        {"op": "read", "x": b"x" * 16, "keys": [[shard, "api:user:1"]], "pos": 0},
        {"op": "read", "x": b"x" * 16, "keys": [[shard, b"api:" + subject]], "pos": 12},
        {"op": "read", "x": b"x" * 16, "keys": "all", "pos": 0},
    ]
    bad_blobs: list[Any] = [
        b"\xc1garbage",
        blob([["a/i0"], b"api:" + subject, ok_cells], bin_type=True),  # bin type
        blob([["a/i0"], "api:user:1"]),  # no cells
        blob({"slots": ["a/i0"]}),
        blob([[], "api:user:1", ok_cells]),
        blob([["no-slash"], "api:user:1", ok_cells]),
        blob([["a/i0", "a/i0"], "api:user:1", ok_cells]),
        blob([["a/i0"], "api:user:1", [c, 1, SUBSTEPS, 0]]),  # slot_ref out of range
        blob([["a/i0"], "api:user:1", [c, 0, -SUBSTEPS, 0]]),
        blob([["a/i0"], "api:user:1", [c, 0, 2**53, 0]]),
        blob([["a/i0"], "api:user:1", [c, 0, SUBSTEPS + 0.5, 0]]),
        blob([["a/i0"], "api:user:1", [c, 0, SUBSTEPS]]),
        blob([["a/i0"], "api:user:1", [c, 0, True, 0]]),
        blob([["a/i0"], "hour:user:1", ok_cells]),  # a rule this exchange did not accept
        blob([["a/i0"], "nope:user:1", ok_cells]),
        blob([["a/i0"], "api:user:2", ok_cells] if b.layout.shard_of(b"user:2") != shard else [["a/i0"], "api:zz", ok_cells]),
        blob([["a/i0"], "api:user:1", ok_cells * (MAX_BLOB_CELLS + 1)]),
        blob([["a/i0"], "api:user:1", [ok_cells[0], 0, SUBSTEPS, 0], "api:user:1", "cells"]),
    ]
    for blob_bytes in bad_blobs:
        bad_requests.append({"op": "push", "x": b"x" * 16, "blobs": [[shard, blob_bytes]]})
    bad_requests += [
        {"op": "push", "x": b"x" * 16, "blobs": [[99, blob([["a/i0"], "api:user:1", ok_cells])]]},
        {"op": "push", "x": b"x" * 16, "blobs": [[shard, "text"]]},
        {"op": "push", "x": b"x" * 16, "blobs": [[shard, blob([["a/i0"], "api:user:1", ok_cells])]] * 9},
        # one good blob then a bad one: nothing may be merged
        {"op": "push", "x": b"x" * 16, "blobs": [[shard, blob([["a/i0"], "api:user:1", ok_cells])], [shard, b"\x00"]]},
    ]
    for request in bad_requests:
        with pytest.raises(ProtocolError):
            await server.handle("a", request)
    # another peer cannot use a's exchange
    with pytest.raises(ProtocolError, match="unknown or expired"):
        await server.handle("c", {"op": "end", "x": b"x" * 16})
    assert not b.merged
    assert b.snapshot() == before
    assert server.stats["refused"] == len(bad_requests) + 1
    await server.close()


async def test_a_bad_scope_of_leaves_is_refused(regions: tuple[Region, Region]) -> None:
    """After a shards-only first pass, the leaves digested are those of the shards in
    the initiator's ``scope``: a malformed scope, or nodes outside it, are refused."""
    a, b = regions
    for i, s in enumerate(subjects(40)):
        b.put(API, s, typical(i))
    server = first_passes(pair(a, b), "shards")["b"]
    begin = {"op": "begin", "x": b"s" * 16, "now": NOW_US, "shards": 16, "leaves": 8,
             "rules": [["api", API.window_us, API.resolution_us]]}
    await server.handle("a", begin)

    async def tree(level: int, nodes: list[int], **extra: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = await server.handle("a", {"op": "tree", "x": b"s" * 16, "level": level, "nodes": nodes, **extra})
            if reply["ready"]:
                return reply
            await asyncio.sleep(0.01)
        raise AssertionError("the pass did not finish in 30 s")

    await tree(0, list(range(16)))
    with pytest.raises(ProtocolError, match="scope"):
        await server.handle("a", {"op": "tree", "x": b"s" * 16, "level": 1, "nodes": [0], "scope": b"\x01"})
    scope = bytes([0b10, 0])  # shard 1 only
    assert len((await tree(1, [8, 9], scope=scope))["d"]) == 16
    with pytest.raises(ProtocolError, match="outside the shards"):
        await server.handle("a", {"op": "tree", "x": b"s" * 16, "level": 1, "nodes": [24], "scope": scope})


async def test_hostile_replies_fail_the_run_and_write_nothing(regions: tuple[Region, Region]) -> None:
    a, b = regions
    for i, s in enumerate(subjects(30)):
        a.put(API, s, typical(i))
    b.put(API, b"user:1", [(bucket(API), "b/i0", SUBSTEPS, 0)])
    sides = pair(a, b)
    real = sides["a"].send

    def tamper(op: str, change: Callable[[dict[str, Any]], None]) -> Callable[[str, dict[str, Any]], Any]:
        async def send(peer: str, payload: dict[str, Any]) -> dict[str, Any]:
            reply = await real(peer, payload)
            if payload["op"] == op and reply.get("ready", True):
                change(reply)
            return reply

        return send

    cases: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("begin", lambda r: r.update(x=b"q" * 16)),
        ("begin", lambda r: r.update(rules=["api", "unknown"])),
        ("tree", lambda r: r.update(d=r["d"][:-1])),
        ("tree", lambda r: r.update(d=b"\xff" * len(r["d"]))),
        ("tree", lambda r: r.update(ready="yes")),
        ("entries", lambda r: r.update(e=[[0, b"api:user:1", -5]])),
        ("entries", lambda r: r.update(e=[[99, b"api:user:1", 5]])),
        ("entries", lambda r: r.update(e=[[0, b"nope:x", 5]])),
        ("read", lambda r: r.update(blobs=[[0, b"\x00\x01"]])),
        ("read", lambda r: r.update(done=10**6)),
        ("read", lambda r: r.update(done=0, pos=0)),
    ]
    before = a.snapshot()
    for op, change in cases:
        sides["a"].send = tamper(op, change)
        with pytest.raises(ProtocolError):
            await sides["a"].run("b")
    assert not a.merged
    assert a.snapshot() == before


async def test_exchanges_are_bounded_and_expire(regions: tuple[Region, Region]) -> None:
    a, b = regions
    idle_clock = [1000.0]
    sides = pair(a, b, exchange_ttl=0.2, monotonic=lambda: idle_clock[0])
    server = sides["b"]

    def begin(x: bytes) -> dict[str, Any]:
        return {"op": "begin", "x": x, "now": NOW_US, "shards": 16, "leaves": 8, "rules": []}

    for x in (b"1" * 16, b"2" * 16, b"3" * 16):
        await server.handle("a", begin(x))
    with pytest.raises(ProtocolError, match="unknown or expired"):  # the oldest was dropped
        await server.handle("a", {"op": "end", "x": b"1" * 16})
    assert (await server.handle("a", {"op": "end", "x": b"3" * 16}))["ok"]
    pending = server._exchanges[b"2" * 16].digest_task
    assert pending is not None
    await asyncio.wait_for(asyncio.shield(pending), timeout=30)  # a pass under way is never idle
    idle_clock[0] += 0.1
    assert server._exchanges, "an exchange idle for less than exchange_ttl is kept"
    idle_clock[0] += 0.15
    with pytest.raises(ProtocolError, match="unknown or expired"):
        await server.handle("a", {"op": "end", "x": b"2" * 16})
    assert server._exchanges == {}

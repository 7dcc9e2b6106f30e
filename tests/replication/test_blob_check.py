"""vet_blob (Python) and merge.lua refuse the same bad blobs with the same reason.

The receiver checks a blob's types and ranges in Python and asks Redis only
about what needs its state (the registry, claims on its own slot). Both
checkers must agree: a blob that one refuses and the other accepts would either
be written unchecked or refused with a reason the docs do not name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgpack
import pytest

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.window import SUBSTEPS
from geolimit.errors import ProtocolError
from geolimit.replication import redis_io
from geolimit.replication.blob_check import MAX_VALUE, vet_blob
from geolimit.replication.redis_io import ReplicationStore

API = Rule("api", 1000, 10, 1)
CLOCK = ManualClock(1_700_000_000.0)
B = CLOCK.now_us() // API.resolution_us
ALLOWED = frozenset({b"r", b"p1", b"p2"})


def blob(slots: list[object], *rest: object) -> bytes:
    """A blob of ``slots`` and (key, flat cells) pairs: [slots, keys, counts, cells]."""
    keys, cells = list(rest[::2]), list(rest[1::2])
    counts = [len(c) // 4 if isinstance(c, list) else c for c in cells]
    flat = [x for c in cells if isinstance(c, list) for x in c]
    return raw([slots, keys, counts, flat])


def raw(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=False)  # type: ignore[no-any-return]


BAD = {
    "not msgpack": (b"\xc1 no", "blob is not msgpack"),
    "no slot list": (msgpack.packb({"a": 1}), "blob has no slot list"),
    "bin slot id (cmsgpack cannot read bin)": (msgpack.packb([[b"p1/1"], [b"api:u"], [1], [B, 0, 5, 0]], use_bin_type=True),
                                               "blob is not msgpack"),
    "bin key": (msgpack.packb([["p1/1"], [b"api:u"], [1], [B, 0, 5, 0]], use_bin_type=True), "blob is not msgpack"),
    "slot id not a string": (blob([7], b"api:u", [B, 0, 5, 0]), "slot id is not a short string"),
    "long slot id": (blob(["p1/" + "x" * 300], b"api:u", [B, 0, 5, 0]), "slot id is not a short string"),
    "slot id without incarnation": (blob(["p1/"], b"api:u", [B, 0, 5, 0]), "slot id is not region/incarnation"),
    "unconfigured region": (blob(["mallory/1"], b"api:u", [B, 0, 5, 0]), "slot of a region that is not configured"),
    "duplicate slot id": (blob(["p1/1", "p1/1"], b"api:u", [B, 0, 5, 0]), "duplicate slot id"),
    "v2 layout": (raw([["p1/1"], b"api:u", [B, 0, 5, 0]]), "blob is not [slots, keys, counts, cells]"),
    "cells not a list": (raw([["p1/1"], [b"api:u"], [1], 5]), "blob is not [slots, keys, counts, cells]"),
    "counts shorter than keys": (raw([["p1/1"], [b"api:u", b"api:v"], [1], [B, 0, 5, 0]]),
                                 "key and count lists differ in length"),
    "key not a string": (blob(["p1/1"], 5, [B, 0, 5, 0]), "bad key"),
    "short key": (blob(["p1/1"], b"a:", [B, 0, 5, 0]), "bad key"),
    "zero count": (raw([["p1/1"], [b"api:u"], [0], []]), "a cell count is not a positive integer"),
    "string count": (raw([["p1/1"], [b"api:u"], ["1"], [B, 0, 5, 0]]), "a cell count is not a positive integer"),
    "ragged cells": (raw([["p1/1"], [b"api:u"], [1], [B, 0, 5]]), "the cells do not match the counts"),
    "cells beyond the counts": (raw([["p1/1"], [b"api:u"], [1], [B, 0, 5, 0, B, 0, 5, 0]]),
                                "the cells do not match the counts"),
    "float bucket": (blob(["p1/1"], b"api:u", [B + 0.5, 0, 5, 0]), "a cell field is not a non-negative integer"),
    "negative value": (blob(["p1/1"], b"api:u", [B, 0, -5, 0]), "a cell field is not a non-negative integer"),
    "string value": (blob(["p1/1"], b"api:u", [B, 0, "5", 0]), "a cell field is not a non-negative integer"),
    "slot ref out of range": (blob(["p1/1"], b"api:u", [B, 1, 5, 0]), "slot reference out of range"),
    "value 2**62": (blob(["p1/1"], b"api:u", [B, 0, 2**62, 0]), "a cell value is out of range"),
    "floor above 2**53": (blob(["p1/1"], b"api:u", [B, 0, SUBSTEPS, MAX_VALUE + 1]), "a cell value is out of range"),
    "too many cells": (blob(["p1/1"], b"api:u", [B, 0, 5, 0] * 9), "too many cells in one blob"),
    "a huge count": (raw([["p1/1"], [b"api:u"], [2**40], [B, 0, 5, 0]]), "too many cells in one blob"),
}


@pytest.fixture
async def store(redis_url: str, redis_client: object) -> AsyncIterator[ReplicationStore]:
    """Region r's replication store on a flushed database (``redis_client`` flushes it)."""
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[API], clock=CLOCK)
    limits = redis_io.Limits(blob_cells=8)
    yield ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                           peers=["p1", "p2"], limits=limits)
    await limiter.aclose()


async def lua_reason(store: ReplicationStore, body: bytes) -> str | None:
    """merge.lua's verdict on ``body`` (check only, nothing written): None if accepted."""
    lim = store.limits
    args = [b"1", store.layout.registry_key(0), b"%d" % CLOCK.now_us(), b"r", b"n0", b"0", b"delta",
            b"%d" % lim.blob_cells, b"%d" % lim.new_slots, b"%d" % lim.max_slots, b"%d" % lim.park_cells,
            b"%d" % round(lim.park_seconds * 1_000_000), b"3", b"r", b"p1", b"p2",
            b"1", b"api", b"%d" % API.resolution_us, b"%d" % API.buckets, b"%d" % API.ring, b"%d" % API.future,
            b"%d" % API.ttl_ms, b"1", b"0", body]
    [reply] = await store.store.run_many(redis_io._MERGE, [args])
    return None if int(reply[0]) == 1 else bytes(reply[1]).decode()


@pytest.mark.parametrize("case", sorted(BAD))
async def test_python_and_lua_refuse_a_bad_blob_for_the_same_reason(store: ReplicationStore, case: str) -> None:
    body, reason = BAD[case]
    with pytest.raises(ProtocolError) as refused:
        vet_blob(body, ALLOWED, max_cells=8, max_slots=256)
    assert str(refused.value) == reason
    assert await lua_reason(store, body) == reason


async def test_a_good_blob_passes_both(store: ReplicationStore) -> None:
    body = blob(["p1/1", "p2/1"], b"api:u", [B, 0, 5 * SUBSTEPS, 0, B, 1, MAX_VALUE, 0], b"other:v", [B, 0, 1, 0])
    vetted = vet_blob(body, ALLOWED, max_cells=8, max_slots=256)
    assert (vetted.slots, vetted.regions, vetted.cells) == ([b"p1/1", b"p2/1"], {b"p1", b"p2"}, 3)
    assert await lua_reason(store, body) is None


@pytest.mark.parametrize("case", ["value 2**62", "bin key"])
async def test_a_refused_blob_leaves_the_merge_unwritten(store: ReplicationStore, redis_url: str, case: str) -> None:
    """The good blob comes first: nothing of it is written when a later one is refused."""
    good = blob(["p1/1"], b"api:u", [B, 0, 5 * SUBSTEPS, 0])
    body, reason = BAD[case]
    shard = store.layout.shard_of(b"u")  # both blobs hold keys of subject u
    with pytest.raises(ProtocolError, match=f"shard {shard}: {reason}"):
        await store.merge_blobs([(shard, good), (shard, body)], "p1")
    assert (await store.read_live(CLOCK.now_us())) == {}

"""Subjects over MAX_SUBJECT_BYTES (4096): refused in deltas, skipped by anti-entropy.

No limiter writes such a subject (encode_subject refuses it), and anti-entropy cannot
exchange one. Until 2026-11-27 merge.lua and blob_check.py accepted keys up to 4200
bytes whatever their subject, so one signed delta with ``api:`` + 4150 bytes planted a
key that the peer listed and then refused to read or take (400): every anti-entropy
run between the two regions failed for as long as the key lived. Now the delta is
refused before anything is written, and a region that already holds such a key (an
older agent merged it) leaves it out of its listings, counts it and logs it, so the
exchange completes and repairs the other keys.

Real redis-servers and real agents (tests/support/regions.py), or the exchange pair
of antientropy_support.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.errors import ProtocolError
from geolimit.replication import redis_io, wire
from geolimit.replication.antientropy import AntiEntropy
from geolimit.replication.auth import Signer
from geolimit.replication.blob_check import vet_blob
from geolimit.replication.redis_io import ReplicationStore, pack_blob
from geolimit.store.embedded import EmbeddedRedis
from tests.replication.antientropy_support import API as AE_API
from tests.replication.antientropy_support import Region, pair, regions, servers, subjects, typical
from tests.support.regions import Regions, dump_all

__all__ = ["regions", "servers"]  # fixtures

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 60, 10)  # 10 s buckets: each test stays in one
LAYOUT = KeyLayout()
LONG = b"L" * (MAX_SUBJECT_BYTES + 54)  # 4150 bytes, as the tester's
REASON = f"a key's subject is over {MAX_SUBJECT_BYTES} bytes"


# -- deltas ------------------------------------------------------------------------


@pytest.fixture
async def two(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    start = float(int(time.time()) // 10 * 10)  # the start of a bucket
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False, clock=ManualClock(start)) as rs:
        await rs.step(2)  # leases, and the first anti-entropy both ways
        rs["b"].app().hit("api", "existing", cost=3)
        await rs.step()
        yield rs


def _delta(rs: Regions, subject: bytes, cost: int = 5) -> bytes:
    cells = [rs.clock.now_us() // API.resolution_us, 0, cost * SUBSTEPS, 0]
    blob = pack_blob(["a/x1"], [b"api:" + subject], [1], cells)
    message = wire.Message(kind="delta", sender="a", dest="b", rules={"api": API.structure}, shards=64,
                           blobs=[(LAYOUT.shard_of(subject), blob)])
    return wire.encode(message)


async def _post(rs: Regions, body: bytes) -> tuple[int, Any]:
    headers = Signer(rs.secret, "a", rs.clock).headers(body, "b")
    async with aiohttp.ClientSession() as http, http.post(rs.urls["b"] + "/v1/gossip", data=body,
                                                           headers=headers) as resp:
        if resp.status == 200:
            return 200, wire.decode(await resp.read()).kind
        return resp.status, await resp.json(content_type=None)


async def test_a_delta_with_a_subject_over_4096_bytes_gets_400_and_changes_nothing(two: Regions) -> None:
    client = two["b"].client()
    before = dump_all(client)
    status, reply = await _post(two, _delta(two, LONG))
    assert status == 400, reply
    assert reply["reason"] == "decode"
    assert REASON in str(reply["error"]), reply
    assert dump_all(client) == before  # byte-identical, the replay guard included
    # The bound is the limiter's: a subject of exactly 4096 bytes still replicates.
    longest = b"k" * MAX_SUBJECT_BYTES
    status, reply = await _post(two, _delta(two, longest, cost=2))
    assert status == 200, reply
    assert two["b"].app().usage("api", longest).by_region == {"a": 2}


@pytest.fixture
async def store(redis_url: str, redis_client: object) -> AsyncIterator[ReplicationStore]:
    """Region r's replication store on a flushed database (``redis_client`` flushes it)."""
    clock = ManualClock(1_700_000_000.0)
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[API], clock=clock)
    yield ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=clock.now_us,
                           peers=["p1"], limits=redis_io.Limits())
    await limiter.aclose()


async def _lua(store: ReplicationStore, body: bytes, apply: bytes) -> str | None:
    """merge.lua's verdict on ``body`` (apply b"0": check only; b"1": check, then write): None if accepted."""
    lim, now = store.limits, 1_700_000_000 * 1_000_000
    args = [b"1", store.layout.registry_key(0), b"%d" % now, b"r", b"n0", apply, b"delta",
            b"%d" % lim.blob_cells, b"%d" % lim.new_slots, b"%d" % lim.max_slots, b"%d" % lim.park_cells,
            b"%d" % round(lim.park_seconds * 1_000_000), b"2", b"r", b"p1",
            b"1", b"api", b"%d" % API.resolution_us, b"%d" % API.buckets, b"%d" % API.ring, b"%d" % API.future,
            b"%d" % API.ttl_ms, b"0", b"0", body]
    [reply] = await store.store.run_many(redis_io._MERGE, [args])
    return None if int(reply[0]) == 1 else bytes(reply[1]).decode()


def _blob(*keys: bytes) -> bytes:
    return pack_blob(["p1/1"], list(keys), [1] * len(keys), [1, 0, 5, 0] * len(keys))


CASES = {  # a blob -> the reason both refuse it for (None: accepted)
    "api: and 4097 bytes": (_blob(b"api:u", b"api:" + b"s" * 4097), REASON),
    "api: and 4096 bytes": (_blob(b"api:u", b"api:" + b"s" * 4096), None),
    "103-byte name, 4096 bytes": (_blob(b"n" * 103 + b":" + b"s" * 4096), None),  # 4200 bytes, of no rule
    "102-byte name, 4097 bytes": (_blob(b"n" * 102 + b":" + b"s" * 4097), REASON),  # ':' at the last place searched
    "4200 bytes without ':'": (_blob(b"n" * 4200), None),
    "a ':' in the subject": (_blob(b"api:" + b"s" * 10 + b":" + b"s" * 4100), REASON),  # the first ':' counts
    "a bad key after it": (_blob(b"api:" + LONG, b"x"), "bad key"),  # every key's size is checked first
}


@pytest.mark.parametrize("apply", [b"0", b"1"])
async def test_python_and_lua_refuse_a_subject_over_4096_bytes_alike(
    store: ReplicationStore, redis_client: Any, apply: bytes
) -> None:
    """merge.lua (check only, or check and write) and vet_blob draw the line at the same byte, for
    the same reason, and write nothing of a refused blob."""
    for case, (body, reason) in CASES.items():
        before = dump_all(redis_client)
        if reason is None:
            assert vet_blob(body, [b"r", b"p1"], 4096, 256).cells >= 1, case
            assert await _lua(store, body, apply) is None, case
            continue
        with pytest.raises(ProtocolError) as refused:
            vet_blob(body, [b"r", b"p1"], 4096, 256)
        assert (str(refused.value), await _lua(store, body, apply)) == (reason, reason), case
        assert dump_all(redis_client) == before, case  # nothing written, not even the good key


# -- anti-entropy with keys that may not be exchanged ---------------------------------


def _same_shard(subject: bytes) -> bytes:
    """A short subject in ``subject``'s shard (a copy of its key then has valid slot indices)."""
    return next(s for s in (b"seed%d" % i for i in range(10_000)) if LAYOUT.shard_of(s) == LAYOUT.shard_of(subject))


def _plant(rs: Regions, region: str, subject: bytes) -> bytes:
    """A key of ``subject`` in ``region``'s Redis as an older agent merged it: a copy of a real key
    of the same shard (live cells, registered slots). Returns its name."""
    seed = _same_shard(subject)
    rs[region].app().hit("api", seed, cost=7)
    client = rs[region].client()
    source, target = LAYOUT.data_key("api", seed), LAYOUT.data_key("api", subject)
    client.restore(target, client.pttl(source), client.dump(source))
    return target


def _ae(rs: Regions, name: str) -> AntiEntropy:
    engine = rs[name].agent.engine
    assert engine is not None
    return engine.repair.ae


async def _exchange(rs: Regions, initiator: str, peer: str) -> None:
    engine = rs[initiator].agent.engine
    assert engine is not None
    ok = engine.peers[peer].ae_ok
    engine.peers[peer].ae_needed = True
    await rs.step(1, [initiator])
    assert engine.peers[peer].ae_ok == ok + 1, engine.peers[peer].ae_last_error
    assert engine.peers[peer].ae_last_error is None


async def test_a_region_holding_a_subject_over_4096_bytes_still_completes_anti_entropy(
    two: Regions, caplog: pytest.LogCaptureFixture
) -> None:
    rs = two
    caplog.set_level(logging.WARNING, "geolimit.antientropy")
    rs["a"].app().hit("api", "only-a", cost=3)
    rs["b"].app().hit("api", "only-b", cost=2)
    await rs.step(2)  # deltas carry the hits both ways
    a_long, b_long = b"A" * 4150, b"B" * 4150
    planted = {"a": _plant(rs, "a", a_long), "b": _plant(rs, "b", b_long)}
    # Keys only anti-entropy can repair: each region loses the other's hit.
    rs["a"].client().delete(LAYOUT.data_key("api", b"only-b"))
    rs["b"].client().delete(LAYOUT.data_key("api", b"only-a"))
    copies = {name: rs[name].client().dump(key) for name, key in planted.items()}

    # a starts: it holds a key it may not push, and b lists (would list) one a may not read.
    await _exchange(rs, "a", "b")
    assert rs["a"].app().usage("api", "only-b").by_region == {"b": 2}
    assert rs["b"].app().usage("api", "only-a").by_region == {"a": 3}
    engine = rs["a"].agent.engine
    assert engine is not None
    assert engine.repair.last["b"].keys_skipped == 1  # a's own; b left its own out of its listing
    status = rs["a"].agent.status()["peers"]["b"]["anti_entropy"]
    assert status["keys_skipped"] == 1, "/v1/status shows the keys the last exchange skipped"
    assert _ae(rs, "a").stats["keys_skipped"] == 1
    assert _ae(rs, "b").stats["keys_skipped"] == 1

    # And the other way round; the later hits are repaired too.
    rs["a"].app().hit("api", "only-a", cost=1)
    rs["b"].client().delete(LAYOUT.data_key("api", b"only-a"))
    await _exchange(rs, "b", "a")
    assert rs["b"].app().usage("api", "only-a").by_region == {"a": 4}
    assert _ae(rs, "a").stats["keys_skipped"] == 2
    assert _ae(rs, "b").stats["keys_skipped"] == 2

    # Neither key travelled, and both are as they were.
    for name, key in planted.items():
        assert rs[name].client().dump(key) == copies[name]
    assert not rs["a"].client().exists(planted["b"])
    assert not rs["b"].client().exists(planted["a"])
    lines = [r.getMessage() for r in caplog.records if "cannot be exchanged" in r.getMessage()]
    assert len(lines) == 2, lines  # once per region within 10 s, not once per exchange
    assert all("subject of 4150 bytes is too long" in line for line in lines), lines


async def test_a_listing_entry_an_older_agent_may_not_exchange_is_skipped(regions: tuple[Region, Region]) -> None:
    """An older responder lists what it holds whatever the subject: the initiator skips such entries
    (and keys of another shard) instead of failing every run; malformed ones still fail the run."""
    a, b = regions
    for i, s in enumerate(subjects(20)):
        b.put(AE_API, s, typical(i))
    sides = pair(a, b)
    real = sides["a"].send
    long_subject = b"x" * 4150
    shard = a.layout.shard_of(long_subject)
    extra = [[shard, b"api:" + long_subject, 5], [(shard + 1) % 16, b"api:" + long_subject[:100], 5]]
    assert a.layout.shard_of(long_subject[:100]) != (shard + 1) % 16

    async def older(peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        reply = await real(peer, payload)
        if payload["op"] == "entries" and reply["ready"] and payload["from"] + len(reply["e"]) >= reply["total"]:
            reply["e"] = reply["e"] + extra  # the last page
            reply["total"] += len(extra)
        return reply

    sides["a"].send = older
    result = await sides["a"].run("b")
    assert result.keys_skipped == 2
    assert result.keys_received == 20
    assert sides["a"].stats["keys_skipped"] == 2
    for s in subjects(20):
        assert a.cells(AE_API, s) == b.cells(AE_API, s)
    assert a.cells(AE_API, long_subject) == {}

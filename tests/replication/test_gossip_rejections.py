"""Gossip that fails authentication, size or decoding leaves Redis byte-identical."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import msgpack
import pytest

from geolimit import ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.replication import wire
from geolimit.replication.auth import SEQ, SIGNATURE, Signer
from geolimit.replication.redis_io import blobs_from_cells, pack_blob
from geolimit.store.embedded import EmbeddedRedis
from tests.support.regions import Regions, dump_all

Factory = Callable[..., EmbeddedRedis]
API = Rule("api", 1000, 10, 1)


@pytest.fixture
async def target(redis_server_factory: Factory) -> AsyncIterator[Regions]:
    """Region b receives; region a is its configured peer (whose secret we hold)."""
    async with Regions(redis_server_factory, ["a", "b"], [API], run_loops=False, max_message_bytes=64 * 1024) as rs:
        await rs.step()
        rs["b"].app().hit("api", "existing", cost=3)
        yield rs


def _blob(cells: list[tuple[int, int, int, int]], slots: list[str], subject: bytes = b"victim") -> bytes:
    """A merge blob for one key of rule api, with raw cells (bucket, slot_ref, value, floor)."""
    flat = [x for cell in cells for x in cell]
    return pack_blob(slots, [b"api:" + subject], [len(cells)], flat)


def _message(blobs: list[tuple[int, bytes]], sender: str = "a", **changes: object) -> bytes:
    message = wire.Message(kind="delta", sender=sender, dest="b", rules={"api": API.structure}, shards=64, blobs=blobs)
    for name, value in changes.items():
        setattr(message, name, value)
    return wire.encode(message)


def _delta(rs: Regions, cost: int = 5, sender: str = "a") -> bytes:
    bucket = rs.clock.now_us() // API.resolution_us  # type: ignore[union-attr]
    cells = [("api", b"victim", bucket, f"{sender}/x1", cost * SUBSTEPS, 0)]  # count * SUBSTEPS + first offset
    return _message(blobs_from_cells(KeyLayout(), cells), sender)


async def _post(rs: Regions, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.post(
        rs.urls["b"] + "/v1/gossip", data=body, headers=headers
    ) as resp:
        if resp.status == 200:
            return 200, {"reply": wire.decode(await resp.read()).kind}
        return resp.status, await resp.json(content_type=None)


def _signer(rs: Regions, region: str = "a", secret: bytes | None = None, skew: float = 0.0) -> Signer:
    clock = rs.clock
    assert isinstance(clock, ManualClock)
    return Signer(secret or rs.secret, region, lambda: clock() + skew)


async def test_a_valid_message_is_merged(target: Regions) -> None:
    body = _delta(target)
    status, _ = await _post(target, body, _signer(target).headers(body, "b"))
    assert status == 200
    assert target["b"].app().usage("api", "victim").total == 5


@pytest.mark.parametrize(
    "case",
    ["unsigned", "forged", "wrong_secret", "stale", "future", "unknown_sender", "tampered_body", "bad_seq"],
)
async def test_bad_authentication_gets_401_and_changes_nothing(target: Regions, case: str) -> None:
    client = target["b"].client()
    before = dump_all(client)
    body = _delta(target)
    headers = _signer(target).headers(body, "b")
    if case == "unsigned":
        headers = {}
    elif case == "forged":
        headers[SIGNATURE] = "0" * 64
    elif case == "wrong_secret":
        headers = _signer(target, secret=b"another-secret-of-32-bytes-long!!").headers(body, "b")
    elif case == "stale":
        headers = _signer(target, skew=-31).headers(body, "b")
    elif case == "future":
        headers = _signer(target, skew=31).headers(body, "b")
    elif case == "unknown_sender":
        body = _delta(target, sender="mallory")
        headers = _signer(target, region="mallory").headers(body, "b")
    elif case == "tampered_body":
        body = _delta(target, cost=500)
    elif case == "bad_seq":
        headers[SEQ] = "not-a-number"
    status, reply = await _post(target, body, headers)
    assert status == 401, reply
    # A correctly signed message whose time is outside the window names the offset.
    assert reply["reason"] == ("clock_skew" if case in ("stale", "future") else "auth")
    if case in ("stale", "future"):
        assert reply["offset"] == pytest.approx(-31 if case == "stale" else 31, abs=1)
    assert dump_all(client) == before


async def test_a_replayed_message_gets_401(target: Regions) -> None:
    body = _delta(target)
    headers = _signer(target).headers(body, "b")
    assert (await _post(target, body, headers))[0] == 200
    client = target["b"].client()
    before = dump_all(client)
    status, reply = await _post(target, body, headers)
    assert status == 401
    assert "replayed" in str(reply["error"])
    assert dump_all(client) == before


async def test_an_oversized_body_gets_413_before_decoding(target: Regions) -> None:
    client = target["b"].client()
    before = dump_all(client)
    body = b"\x00" * (64 * 1024 + 1)
    status, reply = await _post(target, body, _signer(target).headers(body, "b"))
    assert status == 413
    assert reply["reason"] == "too_large"
    assert dump_all(client) == before
    rejected = target["b"].agent.metrics.rejected.labels("too_large")._value.get()
    assert rejected == 1


def _malformed(rs: Regions) -> dict[str, bytes]:
    good = msgpack.unpackb(_delta(rs), raw=False)
    bucket = rs.clock.now_us() // API.resolution_us  # type: ignore[union-attr]
    shard = KeyLayout().shard_of(b"victim")
    own = rs["b"].agent.engine.own_slots[shard] if rs["b"].agent.engine else "b/?"

    def pack(**changes: object) -> bytes:
        return msgpack.packb({**good, **changes}, use_bin_type=True)  # type: ignore[no-any-return]

    def cells(*cells: tuple[int, int, int, int], slots: tuple[str, ...] = ("a/x1",)) -> bytes:
        return _message([(shard, _blob(list(cells), list(slots)))])

    return {
        "not_msgpack": b"\xc1\xc1\xc1 not msgpack",
        "truncated": _delta(rs)[:-3],
        "not_a_map": msgpack.packb([1, 2, 3]),
        "bad_version": pack(v=99),
        "bad_kind": pack(t="explode"),
        "sender_mismatch": pack(**{"from": "b"}),
        "addressed_elsewhere": pack(to="c"),
        "other_shard_count": pack(shards=128),
        "blob_not_bytes": pack(blobs=[[shard, "text"]]),
        "shard_out_of_range": pack(blobs=[[64, _blob([(bucket, 0, 5, 0)], ["a/x1"])]]),
        "huge_array_header": b"\x81\xa1t\xdd\xff\xff\xff\xff",
        "blob_not_msgpack": _message([(shard, b"\xc1 no")]),
        "slot_ref_out_of_range": cells((bucket, 9, 5, 0)),
        "negative_value": cells((bucket, 0, -5, 0)),
        "float_bucket": _message([(shard, pack_blob(["a/x1"], [b"api:victim"], [1], [bucket + 0.5, 0, 5, 0]))]),
        "ragged_cells": _message([(shard, pack_blob(["a/x1"], [b"api:victim"], [1], [bucket, 0, 5]))]),
        "v2_blob": _message([(shard, msgpack.packb([["a/x1"], b"api:victim", [bucket, 0, 5, 0]], use_bin_type=False))]),
        "value_2_62": cells((bucket, 0, 2**62, 0)),
        "floor_2_62": cells((bucket, 0, SUBSTEPS, 2**62)),
        "unconfigured_region_slot": cells((bucket, 0, 5, 0), slots=("mallory/1",)),
        "more_in_receivers_own_slot": cells((bucket, 0, 10**6 * SUBSTEPS, 0), slots=(own,)),
        "floor_above_receivers_own_count": cells((bucket, 0, 0, 10**6 * SUBSTEPS), slots=(own,)),
        "duplicate_slot_ids": cells((bucket, 0, 5, 0), slots=("a/x1", "a/x1")),
        "too_many_new_slot_ids": cells((bucket, 0, 5, 0), slots=tuple(f"a/n{i}" for i in range(40))),
        "key_of_another_shard": _message([((shard + 1) % 64, _blob([(bucket, 0, 5, 0)], ["a/x1"]))]),
        "one_bad_blob_of_two": _message([
            (shard, _blob([(bucket, 0, 5, 0)], ["a/x1"])),
            (shard, _blob([(bucket, 0, 2**62, 0)], ["a/x1"], b"other")),
        ]),
    }


MALFORMED = [
    "not_msgpack", "truncated", "not_a_map", "bad_version", "bad_kind", "sender_mismatch", "addressed_elsewhere",
    "other_shard_count", "blob_not_bytes", "shard_out_of_range", "huge_array_header", "blob_not_msgpack",
    "slot_ref_out_of_range", "negative_value", "float_bucket", "ragged_cells", "v2_blob", "value_2_62", "floor_2_62",
    "unconfigured_region_slot", "more_in_receivers_own_slot", "floor_above_receivers_own_count", "duplicate_slot_ids", "too_many_new_slot_ids",
    "key_of_another_shard", "one_bad_blob_of_two",
]


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_messages_get_400_and_change_nothing(target: Regions, case: str) -> None:
    client = target["b"].client()
    before = dump_all(client)
    body = _malformed(target)[case]
    status, reply = await _post(target, body, _signer(target).headers(body, "b"))
    assert status == 400, (case, reply)
    assert reply["reason"] == "decode"
    assert dump_all(client) == before


async def test_cells_of_a_rule_with_another_structure_are_ignored(target: Regions) -> None:
    client = target["b"].client()
    before = dump_all(client)
    cells = [("api", b"victim", 1, "a/x1", 5, 0)]
    body = _message(blobs_from_cells(KeyLayout(), cells), rules={"api": (20_000_000, 1_000_000, 0)})
    status, _ = await _post(target, body, _signer(target).headers(body, "b"))
    assert status == 200
    after = dump_all(client)
    assert after.pop(b"gl#seen:{b}:a") != before.pop(b"gl#seen:{b}:a", None)  # accepted: its seq is recorded
    assert after == before


async def test_a_message_for_another_region_is_refused_even_with_a_valid_signature(target: Regions) -> None:
    """The signature covers the destination: a message captured on its way to c is useless at b."""
    client = target["b"].client()
    before = dump_all(client)
    body = _delta(target)
    status, reply = await _post(target, body, _signer(target).headers(body, "c"))
    assert status == 401, reply
    assert dump_all(client) == before


async def test_a_peer_whose_clock_is_outside_the_window_is_reported_with_its_offset(
    target: Regions, caplog: pytest.LogCaptureFixture
) -> None:
    body = _delta(target)
    for _ in range(2):
        headers = _signer(target, skew=45).headers(body, "b")
        assert (await _post(target, body, headers))[0] == 401
    async with aiohttp.ClientSession() as http:
        async with http.get(target.urls["b"] + "/v1/status") as resp:
            peer = (await resp.json())["peers"]["a"]
        async with http.get(target.urls["b"] + "/metrics") as resp:
            metrics = await resp.text()
    assert peer["clock_refusals"] == 2
    assert peer["refused_clock_offset"] == pytest.approx(45, abs=0.5)
    assert 'geolimit_peer_clock_refusals_total{peer="a"} 2.0' in metrics
    assert 'geolimit_gossip_rejected_total{reason="clock_skew"} 2.0' in metrics
    logged = [r.getMessage() for r in caplog.records if "refused gossip from a" in r.getMessage()]
    assert len(logged) == 1  # the first refusal, not every one
    assert "+45.0 s off ours" in logged[0]


@pytest.mark.parametrize("offset", [2**62 // 10**6, 31.0, -31.0, -10**9])
async def test_a_body_time_outside_the_auth_window_gets_400_and_moves_no_clock(target: Regions, offset: float) -> None:
    """The body's ``now`` feeds the peer's clock offset (the agreed clock) and its update gap
    (prediction); the header time is checked against the auth window, so must the body's be.
    Once, one signed message with ``now`` = 2**62 set the region's clock correction to +60 s."""
    clock = target.clock
    assert isinstance(clock, ManualClock)
    client = target["b"].client()
    before = dump_all(client)
    peer = target["b"].agent.engine.peers["a"]  # type: ignore[union-attr]
    update_us = peer.update_us
    now_us = max(1, int((clock() + offset) * 1_000_000))
    body = _message([], now_us=now_us)
    status, reply = await _post(target, body, _signer(target).headers(body, "b"))
    assert status == 400, reply
    assert reply["reason"] == "decode"
    assert "now" in str(reply["error"])
    assert dump_all(client) == before
    assert abs(peer.skew) < 1
    assert peer.update_us == update_us


async def test_an_answer_whose_body_time_is_outside_the_auth_window_fails_the_exchange(target: Regions) -> None:
    """Anti-entropy answers feed the sender's clock offset for the peer too (``note_reach``)."""
    a, b = target["a"].agent.engine, target["b"].agent.engine
    assert a is not None
    assert b is not None
    honest = b.message

    def hostile(kind: str, dest: str, blobs: list[tuple[int, bytes]] | None = None) -> wire.Message:
        reply = honest(kind, dest, blobs)
        reply.now_us = 2**62
        return reply

    b.message = hostile  # type: ignore[method-assign]
    a.peers["b"].ae_needed = True
    await target.step(1, ["a"])
    assert abs(a.peers["b"].skew) < 1
    assert "now" in str(a.peers["b"].ae_last_error)


async def test_an_anti_entropy_push_that_merge_lua_refuses_leaves_no_trace(target: Regions) -> None:
    """A push whose slot ids would overfill the shard's registry passes every check in
    Python and is refused by merge.lua: a 400, and Redis byte-identical afterwards (the
    replay guard did not record it), so the same signed push is judged again, not as a replay."""
    signer, shards = _signer(target), KeyLayout().shards
    bucket = target.clock.now_us() // API.resolution_us  # type: ignore[union-attr]
    shard = KeyLayout().shard_of(b"victim")
    for n in range(15):  # 240 incarnations of a: 16 new slot ids per delta, the cap
        blob = _blob([(bucket, j, SUBSTEPS, 0) for j in range(16)], [f"a/i{16 * n + j}" for j in range(16)])
        body = _message([(shard, blob)])
        assert (await _post(target, body, signer.headers(body, "b")))[0] == 200
    xid = b"x" * 16
    begin = _message([], kind="ae", ae={"op": "begin", "x": xid, "now": target.clock.now_us(),  # type: ignore[union-attr]
                                         "shards": shards, "leaves": 1, "rules": [["api", *API.structure[:2]]]})
    assert (await _post(target, begin, signer.headers(begin, "b")))[0] == 200
    blob = _blob([(bucket, j, SUBSTEPS, 0) for j in range(20)], [f"a/r{j}" for j in range(20)])
    push = _message([], kind="ae", ae={"op": "push", "x": xid, "blobs": [[shard, blob]]})
    headers = signer.headers(push, "b")
    client = target["b"].client()
    before = dump_all(client)
    for _ in range(2):
        status, reply = await _post(target, push, headers)
        assert status == 400, reply
        assert "registry is full" in str(reply["error"])
        assert dump_all(client) == before

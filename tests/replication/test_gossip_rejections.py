"""Gossip that fails authentication, size or decoding leaves Redis byte-identical."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import msgpack
import pytest

from geolimit import ManualClock, Rule
from geolimit.replication import wire
from geolimit.replication.auth import SEQ, SIGNATURE, Signer
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


def _delta(rs: Regions, cost: int = 5, sender: str = "a") -> bytes:
    bucket = rs.clock.now_us() // API.resolution_us  # type: ignore[union-attr]
    message = wire.Message(
        kind="delta", sender=sender, rules={"api": API.structure},
        cells=[("api", b"victim", bucket, f"{sender}/x1", cost * 64, 0)],  # count * 64 + first offset
    )
    return wire.encode(message)


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
    status, _ = await _post(target, body, _signer(target).headers(body))
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
    headers = _signer(target).headers(body)
    if case == "unsigned":
        headers = {}
    elif case == "forged":
        headers[SIGNATURE] = "0" * 64
    elif case == "wrong_secret":
        headers = _signer(target, secret=b"another-secret-of-32-bytes-long!!").headers(body)
    elif case == "stale":
        headers = _signer(target, skew=-31).headers(body)
    elif case == "future":
        headers = _signer(target, skew=31).headers(body)
    elif case == "unknown_sender":
        body = _delta(target, sender="mallory")
        headers = _signer(target, region="mallory").headers(body)
    elif case == "tampered_body":
        body = _delta(target, cost=500)
    elif case == "bad_seq":
        headers[SEQ] = "not-a-number"
    status, reply = await _post(target, body, headers)
    assert status == 401, reply
    assert reply["reason"] == "auth"
    assert dump_all(client) == before


async def test_a_replayed_message_gets_401(target: Regions) -> None:
    body = _delta(target)
    headers = _signer(target).headers(body)
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
    status, reply = await _post(target, body, _signer(target).headers(body))
    assert status == 413
    assert reply["reason"] == "too_large"
    assert dump_all(client) == before
    rejected = target["b"].agent.metrics.rejected.labels("too_large")._value.get()
    assert rejected == 1


def _malformed(rs: Regions) -> dict[str, bytes]:
    good = msgpack.unpackb(_delta(rs), raw=False)
    def pack(**changes: object) -> bytes:
        return msgpack.packb({**good, **changes}, use_bin_type=True)  # type: ignore[no-any-return]
    return {
        "not_msgpack": b"\xc1\xc1\xc1 not msgpack",
        "truncated": _delta(rs)[:-3],
        "not_a_map": msgpack.packb([1, 2, 3]),
        "bad_version": pack(v=99),
        "bad_kind": pack(t="explode"),
        "slot_index_out_of_range": pack(keys=[[0, b"victim", [1, 9, 5, 0]]]),
        "rule_index_out_of_range": pack(keys=[[4, b"victim", [1, 0, 5, 0]]]),
        "negative_value": pack(keys=[[0, b"victim", [1, 0, -5, 0]]]),
        "float_bucket": pack(keys=[[0, b"victim", [1.5, 0, 5, 0]]]),
        "ragged_cells": pack(keys=[[0, b"victim", [1, 0, 5]]]),
        "subject_not_bytes": pack(keys=[[0, "victim", [1, 0, 5, 0]]]),
        "sender_mismatch": pack(**{"from": "b"}),
        "huge_array_header": b"\x81\xa1t\xdd\xff\xff\xff\xff",
    }


MALFORMED = [
    "not_msgpack", "truncated", "not_a_map", "bad_version", "bad_kind", "slot_index_out_of_range",
    "rule_index_out_of_range", "negative_value", "float_bucket", "ragged_cells", "subject_not_bytes",
    "sender_mismatch", "huge_array_header",
]


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_messages_get_400_and_change_nothing(target: Regions, case: str) -> None:
    client = target["b"].client()
    before = dump_all(client)
    body = _malformed(target)[case]
    status, reply = await _post(target, body, _signer(target).headers(body))
    assert status == 400, (case, reply)
    assert reply["reason"] == "decode"
    assert dump_all(client) == before


async def test_cells_of_a_rule_with_another_structure_are_ignored(target: Regions) -> None:
    client = target["b"].client()
    before = dump_all(client)
    message = wire.Message(
        kind="delta", sender="a", rules={"api": (20_000_000, 1_000_000)},
        cells=[("api", b"victim", 1, "a/x1", 5, 0)],
    )
    body = wire.encode(message)
    status, _ = await _post(target, body, _signer(target).headers(body))
    assert status == 200
    assert dump_all(client) == before

"""Pure replication parts: wire format, outbox, signatures, digests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from geolimit import AuthenticationError, ProtocolError
from geolimit.replication import wire
from geolimit.replication.auth import SEQ, SIGNATURE, Signer, Verifier
from geolimit.replication.digest import key_digest, partition_digests
from geolimit.replication.outbox import Outbox

cells6 = st.lists(
    st.tuples(
        st.sampled_from(["api", "burst"]),
        st.binary(max_size=40),
        st.integers(0, 2**40),
        st.sampled_from(["us-east/1a", "eu-west/2b", "ap/3"]),
        st.integers(0, 2**50),
        st.integers(0, 2**50),
    ),
    max_size=60,
)


@given(cells6)
def test_wire_round_trip(cells: list[wire.Cell6]) -> None:
    message = wire.Message(kind="delta", sender="us-east", now_us=123, reach={"eu-west": 0.25},
                           rules={"api": (10_000_000, 1_000_000), "burst": (1_000_000, 100_000)}, cells=cells)
    back = wire.decode(wire.encode(message))
    assert sorted(back.cells) == sorted(cells)
    assert back.sender == "us-east"
    assert back.reach == {"eu-west": 0.25}
    assert back.now_us == 123
    assert all(back.rules[c[0]] == message.rules[c[0]] for c in cells)


def test_a_changed_cell_costs_at_most_16_bytes_on_the_wire() -> None:
    bucket = 1_795_313_487
    subjects = [f"user:{i}".encode() for i in range(1000)]
    cells = [("api", s, bucket + b, "us-east/6b02526ee9728", 500 + b, 0) for s in subjects for b in range(2)]
    size = len(wire.encode(wire.Message(kind="delta", sender="us-east", rules={"api": (10**7, 10**6)}, cells=cells)))
    key_bytes = sum(len(s) + 2 + 2 for s in subjects)  # subject, its header, the key's two small ints
    assert (size - key_bytes) / len(cells) <= 16


def test_decode_rejects_garbage_with_protocol_errors() -> None:
    for body in (b"", b"\xc1", b"\x92\x01\x02"):
        with pytest.raises(ProtocolError):
            wire.decode(body)


def test_outbox_merges_by_max_and_acks_only_what_did_not_grow() -> None:
    box = Outbox()
    key = ("api", b"s", 10, "a/1")
    box.add(key, 5, 0, now=1.0)
    box.add(key, 3, 0, now=2.0)  # older value: ignored
    assert box.snapshot() == [(key, 5, 0)]
    sent = box.snapshot()
    box.add(key, 7, 1, now=3.0)  # grew while in flight
    assert box.ack(sent) == 0
    assert box.snapshot() == [(key, 7, 1)]
    assert box.oldest() == 1.0
    assert box.ack(box.snapshot()) == 1
    assert len(box) == 0
    assert box.oldest() is None


def test_outbox_is_bounded_by_cells_not_by_increments() -> None:
    box = Outbox(limit=3)
    for value in range(10_000):
        box.add(("api", b"s", 10, "a/1"), value, 0, now=0.0)
    assert len(box) == 1
    for bucket in range(5):
        box.add(("api", b"t", bucket, "a/1"), 1, 0, now=0.0)
    assert len(box) == 3
    assert box.overflowed == 3
    assert box.prune(lambda k: k[2] < 2) == 2  # buckets 0 and 1 of "t"


def test_signatures_verify_and_detect_replays() -> None:
    now = [1000.0]
    signer = Signer(b"k" * 32, "a", lambda: now[0])
    verifier = Verifier(b"k" * 32, ["a"], 30.0, lambda: now[0])
    headers = signer.headers(b"body")
    assert verifier.verify(headers, b"body") == "a"
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(headers, b"body")
    fresh = signer.headers(b"body")
    assert int(fresh[SEQ]) > int(headers[SEQ])
    with pytest.raises(AuthenticationError, match="bad signature"):
        verifier.verify({**signer.headers(b"body"), SIGNATURE: "00"}, b"body")
    reply = signer.headers(b"reply", seq=int(fresh[SEQ]))
    assert verifier.verify(reply, b"reply", expect_seq=int(fresh[SEQ])) == "a"
    with pytest.raises(AuthenticationError, match="another request"):
        verifier.verify(signer.headers(b"reply", seq=1), b"reply", expect_seq=2)
    assert "k" * 32 not in repr(signer) + repr(verifier)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Signer(b"short", "a")


def test_digests_ignore_order_and_detect_any_difference() -> None:
    a = {("api", b"x"): [(1, "a/1", 5, 0), (2, "b/1", 3, 1)], ("api", b"y"): [(1, "a/1", 1, 0)]}
    b = {("api", b"y"): [(1, "a/1", 1, 0)], ("api", b"x"): [(2, "b/1", 3, 1), (1, "a/1", 5, 0)]}
    assert partition_digests(a) == partition_digests(b)
    c = {**a, ("api", b"x"): [(1, "a/1", 5, 0), (2, "b/1", 3, 2)]}
    assert partition_digests(a) != partition_digests(c)
    assert key_digest("api", b"x", [(1, "a/1", 0, 0)]) == key_digest("api", b"x", [])

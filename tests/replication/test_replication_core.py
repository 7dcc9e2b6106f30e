"""Pure replication parts: wire format and blobs (signatures: test_auth.py)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from geolimit import ProtocolError
from geolimit.core.keys import KeyLayout
from geolimit.replication import wire
from geolimit.replication.redis_io import blobs_from_cells
from tests.support.blobs import unblob

cells6 = st.lists(
    st.tuples(
        st.sampled_from(["api", "burst"]),
        st.binary(max_size=40),
        st.integers(0, 2**40),
        st.sampled_from(["us-east/1a", "eu-west/2b", "ap/3"]),
        st.integers(0, 2**53 - 1),
        st.integers(0, 2**53 - 1),
    ),
    max_size=60,
)


@given(cells6)
def test_wire_round_trip(cells: list[wire.Cell6]) -> None:
    blobs = blobs_from_cells(KeyLayout(), cells, max_cells=16)
    message = wire.Message(kind="delta", sender="us-east", dest="eu-west", now_us=123, reach={"eu-west": 0.25},
                           failing=["ap"], rules={"api": (10_000_000, 1_000_000, 0), "burst": (1_000_000, 100_000, 1)},
                           shards=64, blobs=blobs)
    back = wire.decode(wire.encode(message))
    assert sorted(unblob(back.blobs)) == sorted(cells)
    assert all(shard == KeyLayout().shard_of(c[1]) for shard, blob in back.blobs for c in unblob([(shard, blob)]))
    assert (back.sender, back.dest, back.reach, back.failing, back.now_us, back.shards) == (
        "us-east", "eu-west", {"eu-west": 0.25}, ["ap"], 123, 64)
    assert back.rules == message.rules


def test_a_changed_cell_costs_at_most_16_bytes_on_the_wire() -> None:
    bucket = 1_795_313_487
    subjects = [f"user:{i}".encode() for i in range(1000)]
    cells = [("api", s, bucket + b, "us-east/6b02526ee9728", 500 + b, 0) for s in subjects for b in range(2)]
    message = wire.Message(kind="delta", sender="us-east", dest="eu-west", rules={"api": (10**7, 10**6, 0)}, shards=64,
                           blobs=blobs_from_cells(KeyLayout(), cells))
    size = len(wire.encode(message))
    key_bytes = sum(len(s) + 4 + 2 + 1 for s in subjects)  # "api:" + subject, its header, the cell list's
    assert (size - key_bytes) / len(cells) <= 16


def test_a_partial_delta_says_so_and_a_malformed_flag_is_refused() -> None:
    """``partial``: a region with a worker down (its shards' changes wait) says so in its deltas;
    an older agent's message (no field) is whole."""
    whole = wire.Message(kind="delta", sender="us-east", dest="eu-west", shards=64)
    assert wire.decode(wire.encode(whole)).partial is False
    assert wire.decode(wire.encode(wire.Message(kind="delta", sender="us-east", dest="eu-west", shards=64,
                                                partial=True))).partial is True
    body = msgpack.unpackb(wire.encode(whole))
    body["partial"] = 1
    with pytest.raises(ProtocolError, match="partial must be true or false"):
        wire.decode(msgpack.packb(body))


def test_decode_rejects_garbage_with_protocol_errors() -> None:
    for body in (b"", b"\xc1", b"\x92\x01\x02"):
        with pytest.raises(ProtocolError):
            wire.decode(body)



"""msgpack bombs: a body within the size cap that decodes into millions of objects.

A signed 16 MB blob of 16 million empty arrays took an agent 6 s and 870 MB to refuse,
on its event loop (decisions waited that long); an envelope of 250 x 65,535 empty
arrays, each within msgpack's per-array limit, 9 s and 1 GB. Each decoder now counts
containers as msgpack builds them and stops at the first one too many, so the bombs
are refused with a few kilobytes of memory; real messages decode as before.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from geolimit.core.keys import KeyLayout
from geolimit.errors import ProtocolError
from geolimit.replication import escrow_wire, wire
from geolimit.replication.antientropy.checks import check_blob
from geolimit.replication.blob_check import vet_blob
from geolimit.replication.redis_io import blobs_from_cells


def arrays_of_empty_arrays(outer: int, inner: int) -> bytes:
    """msgpack of ``outer`` arrays of ``inner`` empty arrays, written directly (building it
    with packb would cost the test the memory the decoders must not spend)."""
    return b"\xdd" + outer.to_bytes(4, "big") + (b"\xdd" + inner.to_bytes(4, "big") + b"\x90" * inner) * outer


def with_field(head: dict[str, Any], name: str, packed: bytes) -> bytes:
    """msgpack of the map ``head`` plus ``name`` -> the already packed value."""
    body = msgpack.packb(head)
    return bytes([body[0] + 1]) + body[1:] + msgpack.packb(name) + packed


EMPTY_ARRAYS = b"\x94" + arrays_of_empty_arrays(1, 4_000_000)[5:] + b"\x90\x90\x90"  # [[4M x []], [], [], []]
ENVELOPE = with_field({"v": wire.VERSION, "t": "ae", "from": "a"}, "ae", arrays_of_empty_arrays(60, 65_535))
ESCROW = with_field({"v": escrow_wire.VERSION, "t": "push", "from": "a"}, "keys", arrays_of_empty_arrays(60, 65_535))


def peak_bytes(call: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("decode", [
    pytest.param(lambda: vet_blob(EMPTY_ARRAYS, [b"a"], 4096, 256), id="delta-blob"),
    pytest.param(lambda: check_blob(EMPTY_ARRAYS, 0, KeyLayout(shards=1), {}), id="anti-entropy-blob"),
    pytest.param(lambda: wire.decode(ENVELOPE), id="gossip-envelope"),
    pytest.param(lambda: escrow_wire.decode(ESCROW), id="escrow-envelope"),
])
def test_a_bomb_is_refused_without_building_it(decode: Callable[[], Any]) -> None:
    assert peak_bytes(decode) < 16 * 1024 * 1024  # built whole: 250 MB (blobs) and 250 MB (envelopes)


def test_real_messages_still_decode() -> None:
    cells = [("api", b"s%d" % i, 100, "a/x", 64, 1) for i in range(4096)]
    [(_, blob)] = blobs_from_cells(KeyLayout(shards=1), cells, max_cells=4096)
    assert vet_blob(blob, [b"a"], 4096, 256).cells == 4096
    message = wire.Message(kind="delta", sender="a", dest="b", rules={"api": (10, 1, 0)}, shards=64,
                           blobs=[(s, blob) for s in range(wire.MAX_BLOBS)])
    assert len(wire.decode(wire.encode(message)).blobs) == wire.MAX_BLOBS

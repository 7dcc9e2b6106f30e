"""The merge blob: one shard's cells for a peer, as ``pack.lua`` writes and ``merge.lua`` reads them."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

__all__ = ["pack_blob", "unpack_blob"]


def pack_blob(slots: Sequence[str | bytes], keys: Sequence[bytes], counts: Sequence[int], cells: Sequence[int]) -> bytes:
    """A merge blob: ``[slot ids, keys, cells per key, flat cells]``.

    Redis's cmsgpack reads only the raw (str) type: no bin.
    """
    return msgpack.packb([list(slots), list(keys), list(counts), list(cells)], use_bin_type=False)  # type: ignore[no-any-return]


def unpack_blob(blob: bytes) -> tuple[list[bytes], list[tuple[bytes, list[int]]]]:
    """A blob's slot ids and its ``(rule:subject, flat cells)`` per key (tests, benches, tools;
    the agent never decodes a blob's cells in Python). The blob must be well formed."""
    slots, keys, counts, flat = msgpack.unpackb(blob, raw=True)
    out: list[tuple[bytes, list[int]]] = []
    at = 0
    for suffix, count in zip(keys, counts, strict=True):
        out.append((suffix, flat[at : at + 4 * count]))
        at += 4 * count
    return slots, out

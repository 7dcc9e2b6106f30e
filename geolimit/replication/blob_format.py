"""The merge blob: one shard's cells for a peer, as ``pack.lua`` writes and ``merge.lua`` reads them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgpack

from geolimit.core.keys import KeyLayout
from geolimit.replication.wire import Blob, Cell6

__all__ = ["blobs_from_cells", "pack_blob", "unpack_blob"]


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


def blobs_from_cells(layout: KeyLayout, cells: Iterable[Cell6], max_cells: int = 2048) -> list[Blob]:
    """Pack Python-side cells into merge blobs (anti-entropy and tests; not the hot path)."""
    by_shard: dict[int, dict[tuple[str, bytes], list[tuple[int, str, int, int]]]] = {}
    for rule, subject, bucket, slot, value, floor in cells:
        keys = by_shard.setdefault(layout.shard_of(subject), {})
        keys.setdefault((rule, subject), []).append((bucket, slot, value, floor))
    out: list[Blob] = []
    for shard, keys in by_shard.items():
        blob = _BlobBuilder()
        for (rule, subject), key_cells in keys.items():
            suffix = rule.encode() + b":" + subject
            for start in range(0, len(key_cells), max_cells):  # a large key spans several blobs
                chunk = key_cells[start : start + max_cells]
                if blob.cells and blob.cells + len(chunk) > max_cells:
                    out.append((shard, blob.pack()))
                    blob = _BlobBuilder()
                blob.add(suffix, chunk)
                if blob.cells >= max_cells:
                    out.append((shard, blob.pack()))
                    blob = _BlobBuilder()
        if blob.cells:
            out.append((shard, blob.pack()))
    return out


class _BlobBuilder:
    """One blob: ``[slot ids, keys, cells per key, flat cells]`` (pack.lua's layout)."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        self.keys: list[bytes] = []
        self.counts: list[int] = []
        self.flat: list[int] = []
        self.cells = 0

    def add(self, suffix: bytes, cells: Sequence[tuple[int, str, int, int]]) -> None:
        for bucket, slot, value, floor in cells:
            self.flat += (bucket, self.slots.setdefault(slot, len(self.slots)), value, floor)
        self.keys.append(suffix)
        self.counts.append(len(cells))
        self.cells += len(cells)

    def pack(self) -> bytes:
        return pack_blob(list(self.slots), self.keys, self.counts, self.flat)

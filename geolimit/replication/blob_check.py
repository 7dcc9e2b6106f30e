"""Checks of a peer's cell blob that need no Redis state. No I/O.

A blob (see :mod:`geolimit.replication.wire`) is ``[slots, keys, counts, cells]``.
:func:`vet_blob` runs the same type, size and range checks as ``merge.lua`` with
the same reasons, using C-level builtins over the flat cell list (about 0.1 µs a
cell), so the receiver's Redis does not have to unpack and walk every blob twice.
What needs Redis state stays in ``merge.lua``: the slot registry (new slot ids,
a full registry) and claims on the receiver's own current slot.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.errors import ProtocolError
from geolimit.replication.msgpack_bounds import unpack_bounded

__all__ = ["MAX_VALUE", "VettedBlob", "vet_blob"]

#: 2**53 - 1: the largest integer Redis's Lua (doubles) holds exactly.
MAX_VALUE = 2**53 - 1
MAX_SLOT_ID = 200
MAX_SUFFIX = 4200
#: Keys longer than this may hold a subject over MAX_SUBJECT_BYTES (after ``rule:``).
_SUBJECT_SAFE = MAX_SUBJECT_BYTES + 1


@dataclass(frozen=True, slots=True)
class VettedBlob:
    slots: list[bytes]  # the blob's slot ids, in order
    regions: frozenset[bytes]  # the regions those slot ids belong to
    cells: int


def _refuse(why: str) -> ProtocolError:
    return ProtocolError(why)


def vet_blob(
    blob: bytes, allowed: Collection[bytes], max_cells: int, max_slots: int, shard: int | None = None,
    shards: int = 0,
) -> VettedBlob:
    """Check ``blob``'s structure, types and ranges; raise :class:`ProtocolError` naming the first fault
    (in the words ``merge.lua`` uses).

    ``allowed``: the configured regions (slot ids of other regions are refused). With
    ``shard`` (of ``shards``), every key's subject must belong to that shard
    (``KeyLayout.shard_of``): ``merge.lua`` writes a blob's keys under the shard's tag,
    so a key of another shard became a stray key that no decision reads.
    """
    try:
        # Redis's cmsgpack reads neither bin nor ext: refuse them here, or a blob
        # Python accepts would fail in merge.lua after other blobs were written.
        # A blob is five arrays of strings and integers: no more containers (maps count),
        # and no string or array over twice what a key or the cells may be (the checks
        # below then name the fault as merge.lua does; msgpack_bounds).
        t = unpack_bounded(blob, 5, raw=True, use_list=True, strict_map_key=False, max_bin_len=0, max_ext_len=0,
                           max_str_len=2 * MAX_SUFFIX, max_array_len=max(8 * max_cells, max_slots))
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise _refuse("blob is not msgpack") from exc
    if not isinstance(t, list) or not t or not isinstance(t[0], list):
        raise _refuse("blob has no slot list")
    slots: list[bytes] = t[0]
    if len(slots) > max_slots:
        raise _refuse("too many slot ids in one blob")
    regions: set[bytes] = set()
    for sid in slots:
        if type(sid) is not bytes or len(sid) > MAX_SLOT_ID:
            raise _refuse("slot id is not a short string")
        region, _, incarnation = sid.rpartition(b"/")
        if not region or not incarnation:
            raise _refuse("slot id is not region/incarnation")
        if region not in allowed:
            raise _refuse("slot of a region that is not configured")
        regions.add(region)
    if len(set(slots)) != len(slots):
        raise _refuse("duplicate slot id")
    if len(t) != 4 or type(t[1]) is not list or type(t[2]) is not list or type(t[3]) is not list:
        raise _refuse("blob is not [slots, keys, counts, cells]")
    keys: list[Any] = t[1]  # msgpack's objects: their types are checked next
    counts: list[Any] = t[2]
    flat: list[Any] = t[3]
    if len(counts) != len(keys):
        raise _refuse("key and count lists differ in length")
    if keys:
        if not set(map(type, keys)) <= {bytes}:
            raise _refuse("bad key")
        sizes = list(map(len, keys))
        if min(sizes) < 3 or max(sizes) > MAX_SUFFIX:
            raise _refuse("bad key")
        # No limiter writes a subject over MAX_SUBJECT_BYTES, and anti-entropy refuses to
        # exchange one: such a key would fail every exchange while it lives. The subject
        # follows the first ':', so only a key over _SUBJECT_SAFE bytes can hold one, and
        # only if a ':' comes within its first len - _SUBJECT_SAFE bytes (at most 103).
        if max(sizes) > _SUBJECT_SAFE and any(
            b":" in k[: len(k) - _SUBJECT_SAFE] for k in keys if len(k) > _SUBJECT_SAFE
        ):
            raise _refuse(f"a key's subject is over {MAX_SUBJECT_BYTES} bytes")
        # bool is not int here (type() is exact), as msgpack never decodes one to an int
        if not set(map(type, counts)) <= {int} or min(counts) < 1:
            raise _refuse("a cell count is not a positive integer")
        if shard is not None and any(zlib.crc32(k.partition(b":")[2]) % shards != shard for k in keys):
            raise _refuse(f"a key does not belong to shard {shard}")
    total: int = sum(counts)
    if total > max_cells:
        raise _refuse("too many cells in one blob")
    if len(flat) != 4 * total:
        raise _refuse("the cells do not match the counts")
    if flat:
        if not set(map(type, flat)) <= {int} or min(flat) < 0:
            raise _refuse("a cell field is not a non-negative integer")
        if max(flat[1::4]) >= len(slots):
            raise _refuse("slot reference out of range")
        if max(flat) > MAX_VALUE:
            raise _refuse("a cell value is out of range")
    return VettedBlob(slots, frozenset(regions), total)

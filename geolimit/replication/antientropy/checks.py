"""Anti-entropy: validation of every field a peer sends (ProtocolError before any write)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from geolimit.core.keys import MAX_SUBJECT_BYTES, KeyLayout
from geolimit.core.rule import Rule
from geolimit.errors import ProtocolError
from geolimit.replication.antientropy.common import (
    MAX_BLOB_BYTES,
    MAX_BLOB_CELLS,
    MAX_BLOB_SLOTS,
    MAX_SLOT_ID,
    MAX_SUFFIX,
    MAX_VALUE,
    Blob,
)
from geolimit.replication.msgpack_bounds import unpack_bounded

# -- validation ----------------------------------------------------------------


def _int(payload: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    value = payload.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"anti-entropy: field {name!r} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def _bytes(payload: Mapping[str, Any], name: str, max_len: int, exact: int | None = None) -> bytes:
    value = payload.get(name)
    if type(value) is not bytes or len(value) > max_len or (exact is not None and len(value) != exact):
        size = exact if exact is not None else f"at most {max_len}"
        raise ProtocolError(f"anti-entropy: field {name!r} must be {size} bytes, got {_show(value)}")
    return value


def _list(payload: Mapping[str, Any], name: str, max_len: int) -> list[Any]:
    value = payload.get(name)
    if type(value) is not list or len(value) > max_len:
        raise ProtocolError(f"anti-entropy: field {name!r} must be a list of at most {max_len} items, got {_show(value)}")
    return value


def _bool(payload: Mapping[str, Any], name: str) -> bool:
    value = payload.get(name)
    if type(value) is not bool:
        raise ProtocolError(f"anti-entropy: field {name!r} must be true or false, got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _pair(item: object, what: str) -> tuple[int, bytes]:
    if type(item) is not list or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not bytes:
        raise ProtocolError(f"anti-entropy: {what} must be [shard, bytes], got {_show(item)}")
    return item[0], item[1]


class _Unexchangeable(ProtocolError):
    """A key of a rule of the exchange, in one of the layout's shards, that no region may exchange:
    its subject is over ``MAX_SUBJECT_BYTES`` or belongs to another shard.

    Neither a limiter nor ``merge.lua`` writes such a key, but a Redis may hold one that an
    older agent merged. A region skips and counts the ones it holds (listings); a peer's
    step that names one is refused like any bad input."""


def _check_suffix(layout: KeyLayout, rules: Mapping[str, Rule], shard: int, suffix: bytes) -> Rule:
    """The rule of ``rule:subject`` in ``shard``; ProtocolError unless it is one of ``rules``,
    :class:`_Unexchangeable` if its subject is too long or of another shard."""
    if not 0 <= shard < layout.shards:
        raise ProtocolError(f"anti-entropy: shard {shard} out of range (this region has {layout.shards})")
    # A rule name is 1 to 64 characters (MAX_SUFFIX = 65 + MAX_SUBJECT_BYTES), then ':'.
    cut = suffix.find(b":", 0, MAX_SUFFIX - MAX_SUBJECT_BYTES)
    try:
        rule = rules.get(suffix[:cut].decode()) if cut > 0 else None
    except UnicodeDecodeError:
        rule = None
    if rule is None:
        raise ProtocolError(f"anti-entropy: key {suffix[:80]!r} is not of a rule of this exchange")
    if len(suffix) - cut - 1 > MAX_SUBJECT_BYTES:
        raise _Unexchangeable(f"anti-entropy: subject of {len(suffix) - cut - 1} bytes is too long")
    if layout.shard_of(suffix[cut + 1 :]) != shard:
        raise _Unexchangeable(f"anti-entropy: key {suffix[:80]!r} does not belong to shard {shard}")
    return rule


def check_blob(blob: bytes, shard: int, layout: KeyLayout, rules: Mapping[str, Rule]) -> tuple[int, int]:
    """Check one repair blob of ``shard`` completely; returns ``(keys, cells)``.

    Format: msgpack (str/raw types only, no bin) ``[slot ids, keys, counts, cells]``:
    ``keys`` are ``rule:subject``, ``counts`` the cells of each key, and ``cells`` a
    flat ``bucket, slot_ref, value, floor, ...`` list in key order.
    Raises :class:`ProtocolError` naming what is wrong.
    """
    if type(blob) is not bytes or len(blob) > MAX_BLOB_BYTES:
        raise ProtocolError(f"anti-entropy: blob must be at most {MAX_BLOB_BYTES} bytes")
    try:
        obj = unpack_bounded(  # five arrays: [slots, keys, counts, cells]
            blob, 5, raw=True, use_list=True, max_str_len=MAX_BLOB_BYTES, max_bin_len=0,
            max_array_len=4 * MAX_BLOB_CELLS, max_map_len=0, max_ext_len=0,
        )
    except Exception as exc:
        raise ProtocolError(f"anti-entropy: undecodable blob: {exc}") from exc
    if type(obj) is not list or len(obj) != 4 or not all(type(part) is list for part in obj):
        raise ProtocolError("anti-entropy: a blob must be [slots, keys, counts, cells]")
    slots = obj[0]
    if type(slots) is not list or not 0 < len(slots) <= MAX_BLOB_SLOTS:
        raise ProtocolError(f"anti-entropy: a blob needs 1 to {MAX_BLOB_SLOTS} slot ids")
    for slot in slots:
        if type(slot) is not bytes or not 3 <= len(slot) <= MAX_SLOT_ID:
            raise ProtocolError(f"anti-entropy: bad slot id {_show(slot)}")
        region, sep, incarnation = slot.rpartition(b"/")
        if not sep or not region or not incarnation:
            raise ProtocolError(f"anti-entropy: slot id {slot[:80]!r} is not region/incarnation")
    if len(set(slots)) != len(slots):
        raise ProtocolError("anti-entropy: a blob names a slot twice")
    keys, counts, cells = obj[1], obj[2], obj[3]
    if not keys or len(keys) != len(counts):
        raise ProtocolError("anti-entropy: a blob needs keys, each with a cell count")
    for suffix in keys:
        if type(suffix) is not bytes:
            raise ProtocolError(f"anti-entropy: bad key in blob: {_show(suffix)}")
        _check_suffix(layout, rules, shard, suffix)
    if not all(type(n) is int and n > 0 for n in counts):
        raise ProtocolError("anti-entropy: cell counts must be positive integers")
    total = sum(counts)
    if total > MAX_BLOB_CELLS:
        raise ProtocolError(f"anti-entropy: a blob holds more than {MAX_BLOB_CELLS} cells")
    if len(cells) != 4 * total:
        raise ProtocolError("anti-entropy: the cells do not match the cell counts")
    if not all(type(x) is int for x in cells):
        raise ProtocolError("anti-entropy: cells must be integers")
    if min(cells) < 0 or max(cells) >= MAX_VALUE:
        raise ProtocolError("anti-entropy: cell number out of range [0, 2**53)")
    if max(cells[1::4]) >= len(slots):
        raise ProtocolError("anti-entropy: cell names a slot the blob does not list")
    return len(keys), total


def _check_blobs(items: list[Any], layout: KeyLayout, rules: Mapping[str, Rule], max_bytes: int) -> tuple[list[Blob], int]:
    blobs: list[Blob] = []
    cells = size = 0
    for item in items:
        shard, blob = _pair(item, "a blob entry")
        size += len(blob)
        if size > max_bytes:
            raise ProtocolError(f"anti-entropy: blobs exceed {max_bytes} bytes")
        cells += check_blob(blob, shard, layout, rules)[1]
        blobs.append((shard, blob))
    return blobs, cells

"""A key's stored cells: ring positions, cell values and floors, and reading a key back.

Pure, and mirrors ``geolimit/store/lua/*.lua`` exactly, like the window maths of
:mod:`geolimit.core.window` (which re-exports everything here).

A key's hash stores one field per (slot, bucket) at the *ring position*
``slot * M + (b mod M)``, where ``M = N + F + 1`` (see :class:`~geolimit.core.rule.Rule`).
The field ``h`` (the key's *head*) holds the newest bucket written; a position
``p`` therefore always means bucket ``h - ((h - p) mod M)``. When the head moves
forward, positions it passes over are cleared, so a field can never be misread
as a newer bucket, however long the key lives.

Reset floors live at field ``-(f + 1)`` for value field ``f``.

A stored value is ``count * SUBSTEPS + first``, where ``first`` is the offset of
the cell's first admission within its bucket, in ``1/SUBSTEPS`` of the bucket.
It only grows (the count grows, ``first`` never changes), so max-merge still
works; approximate mode uses it to know where in the oldest bucket traffic
began. A slot's effective count is ``max(0, count(value) - count(floor))``.

Lua numbers are doubles, so a stored value must stay below ``2**53``: limits
and costs are capped at :data:`MAX_COUNT` (``2**46``), which keeps
``count * SUBSTEPS + first`` of a cell within :data:`MAX_CELL_VALUE` (hits after
a reset add on top of the floored value, so only repeated resets and refills of
a huge limit within one bucket could pass it). The scripts write every number
as a ``%d``-formatted string; :func:`read_key` still tolerates anything else it
finds (see :func:`parse_stored_int`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "HEAD_FIELD",
    "MAX_CELL_VALUE",
    "MAX_COUNT",
    "SUBSTEPS",
    "KeyView",
    "bucket_at",
    "count_of",
    "field_of",
    "floor_field_of",
    "parse_stored_int",
    "read_key",
    "split_field",
]

HEAD_FIELD = "h"
SUBSTEPS = 64
#: The largest limit and the largest cost of one request (both inclusive): the
#: units a cell gains between resets never exceed it, so ``count * SUBSTEPS +
#: first`` stays exact in a Lua double.
MAX_COUNT = 2**46
#: The largest number a hash may hold and still be read exactly by Lua (2**53 - 1).
MAX_CELL_VALUE = 2**53 - 1

_INTEGER_RE = re.compile(rb"-?[0-9]{1,20}")
_FLOAT_RE = re.compile(rb"-?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][+-]?[0-9]{1,3})?")


def parse_stored_int(raw: bytes | str, *, signed: bool = False) -> int | None:
    """A number read from a Redis hash, or ``None`` if it is not a usable one.

    Accepts a plain integer, or a float-formatted integral number such as
    ``b"6.4e+09"`` (what Redis 7.2.0-7.2.4 made of round Lua numbers), with an
    absolute value of at most :data:`MAX_CELL_VALUE`. Negative numbers only with
    ``signed`` (field names of reset floors). Anything else (garbage, NaN, a
    fraction, a value past what a Lua double holds exactly) is ``None``.
    """
    data = raw.encode("ascii", "replace") if isinstance(raw, str) else bytes(raw)
    if _INTEGER_RE.fullmatch(data):
        value = int(data)
    elif _FLOAT_RE.fullmatch(data):
        number = float(data)
        if not math.isfinite(number) or not number.is_integer() or abs(number) > MAX_CELL_VALUE:
            return None
        value = int(number)
    else:
        return None
    if abs(value) > MAX_CELL_VALUE or (value < 0 and not signed):
        return None
    return value


def count_of(value: int) -> int:
    """The count a stored cell value holds."""
    return value // SUBSTEPS

def field_of(slot: int, bucket: int, ring: int) -> int:
    """The value field of ``slot`` for ``bucket``."""
    return slot * ring + bucket % ring


def floor_field_of(value_field: int) -> int:
    """The reset-floor field that pairs with ``value_field``."""
    return -value_field - 1


def split_field(field: int, ring: int) -> tuple[bool, int, int]:
    """``(is_floor, slot, position)`` of a numeric field."""
    is_floor = field < 0
    if is_floor:
        field = -field - 1
    return is_floor, field // ring, field % ring


def bucket_at(position: int, head: int, ring: int) -> int:
    """The bucket that ring ``position`` holds, given the key's head bucket."""
    return head - (head - position) % ring


@dataclass(frozen=True, slots=True)
class KeyView:
    """A key's hash read relative to the current bucket (what ``load_window`` returns)."""

    sums: list[int]
    future: dict[int, int]
    head: int | None
    own: int  # raw stored value of this region's cell in the current bucket
    stale: list[bytes]
    cells: dict[tuple[int, int], tuple[int, int]]  # (slot index, bucket) -> raw (value, floor)
    firsts: list[int]  # earliest first-admission offset per bucket of the window
    bad: int = 0  # fields ignored because their name or value is not a valid number


def read_key(
    fields: Mapping[bytes, bytes], current: int, buckets: int, ring: int
) -> KeyView:
    """Interpret a key's raw ``HGETALL`` relative to bucket ``current``.

    Same result as the Lua ``load_window``, plus every live cell by slot index.
    Fields whose name or value is not a valid stored number (see
    :func:`parse_stored_int`) are ignored as if absent and counted in ``bad``; an
    unreadable head counts as no head.
    """
    sums = [0] * (buckets + 1)
    firsts = [SUBSTEPS] * (buckets + 1)
    if not fields:
        return KeyView(sums, {}, None, 0, [], {}, firsts)
    bad = 0
    raw_head = fields.get(b"h")
    parsed_head = None if raw_head is None else parse_stored_int(raw_head)
    if raw_head is not None and parsed_head is None:
        bad += 1
    head = current if parsed_head is None else parsed_head
    values: dict[int, int] = {}
    floors: dict[int, int] = {}
    stale: list[bytes] = []
    for name, raw in fields.items():
        if name in (b"h", b"e", b"u", b"l") or name[:1] == b"p":
            # the head, the expiry mark, this region's own recent admissions, the low mark (merge.lua),
            # a peer's last rise (common.lua)
            continue
        f = parse_stored_int(name, signed=True)
        if f is None:
            bad += 1
            continue
        base = -f - 1 if f < 0 else f
        if bucket_at(base % ring, head, ring) < current - buckets:
            stale.append(name)
            continue
        value = parse_stored_int(raw)
        if value is None:
            bad += 1
        elif f < 0:
            floors[base] = value
        else:
            values[base] = value
    future: dict[int, int] = {}
    cells: dict[tuple[int, int], tuple[int, int]] = {}
    own = values.get(current % ring, 0)
    for f in set(values) | set(floors):
        value, floor = values.get(f, 0), floors.get(f, 0)
        bucket = bucket_at(f % ring, head, ring)
        cells[(f // ring, bucket)] = (value, floor)
        if f not in values:
            continue
        count, floored = count_of(value), count_of(floor)
        eff = count - min(count, floored)
        delta = current - bucket
        if delta < 0:
            future[bucket] = future.get(bucket, 0) + eff
        elif delta <= buckets:
            sums[delta] += eff
            firsts[delta] = min(firsts[delta], value % SUBSTEPS)
    return KeyView(sums, future, parsed_head, own, stale, cells, firsts, bad)

"""The gossip wire format (msgpack), with strict validation. No I/O.

A message body is a msgpack map::

    {"v": 1, "t": KIND, "from": REGION, "reach": {PEER: SECONDS_SINCE_LAST_ACK, ...},
     "now": MICROSECONDS,                       # sender clock (anti-entropy window)
     "rules": [[NAME, WINDOW_US, RESOLUTION_US], ...],
     "slots": [SLOT_ID, ...],                   # "region/incarnation"
     "keys": [[RULE_INDEX, SUBJECT, [BUCKET, SLOT_INDEX, VALUE, FLOOR, ...]], ...],
     "digests": {PARTITION: DIGEST, ...},       # kind "digest" only
     "want": [PARTITION, ...]}                  # partitions the sender asks for

KIND is ``delta`` (changed cells), ``digest`` (anti-entropy: partition digests),
or ``cells`` (anti-entropy: every live cell of some partitions). A cell is four
unsigned integers in a flat list, so a changed (bucket, slot, value) costs about
8-12 bytes; the subject's bytes are sent once per key per message.

Responses use the same encoding (kind ``ack``; an anti-entropy answer carries
``want``, ``keys`` and ``digests`` like a request).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from geolimit.errors import ProtocolError

__all__ = ["KINDS", "Cell6", "Message", "decode", "encode"]

VERSION = 1
KINDS = ("delta", "digest", "cells", "ack")
MAX_UINT = 2**63 - 1
#: (rule, subject, bucket, slot id, value, floor)
Cell6 = tuple[str, bytes, int, str, int, int]


@dataclass(slots=True)
class Message:
    kind: str
    sender: str
    now_us: int = 0
    reach: dict[str, float] = field(default_factory=dict)
    rules: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (window_us, res_us)
    cells: list[Cell6] = field(default_factory=list)
    digests: dict[int, int] = field(default_factory=dict)
    want: list[int] = field(default_factory=list)


def encode(message: Message) -> bytes:
    """Serialise a message; cells are grouped by key and slots by index."""
    rule_index: dict[str, int] = {}
    slot_index: dict[str, int] = {}
    keys: dict[tuple[str, bytes], list[int]] = {}
    for rule, subject, bucket, slot, value, floor in message.cells:
        flat = keys.get((rule, subject))
        if flat is None:
            flat = keys[(rule, subject)] = []
        s = slot_index.get(slot)
        if s is None:
            s = slot_index[slot] = len(slot_index)
        flat += (bucket, s, value, floor)
    rules = []
    for rule, _ in keys:
        if rule not in rule_index:
            rule_index[rule] = len(rule_index)
            window_us, res_us = message.rules.get(rule, (0, 0))
            rules.append([rule, window_us, res_us])
    body: dict[str, Any] = {
        "v": VERSION,
        "t": message.kind,
        "from": message.sender,
        "now": message.now_us,
        "reach": message.reach,
        "rules": rules,
        "slots": list(slot_index),
        "keys": [[rule_index[rule], subject, flat] for (rule, subject), flat in keys.items()],
    }
    if message.digests:
        body["digests"] = message.digests
    if message.want:
        body["want"] = message.want
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"malformed gossip message: {what}")


def _uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_UINT:
        raise _fail(f"{what} must be an unsigned integer, got {value!r}")
    return value


def _str(value: object, what: str, limit: int = 256) -> str:
    if type(value) is not str or not value or len(value) > limit:
        raise _fail(f"{what} must be a non-empty string of at most {limit} characters")
    return value


def decode(body: bytes, max_cells: int = 2_000_000) -> Message:
    """Parse and validate a message; any defect raises :class:`ProtocolError`."""
    try:
        raw = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            max_str_len=1 << 16,
            max_bin_len=1 << 16,
            max_array_len=4 * max_cells,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"gossip body is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict):
        raise _fail("the body must be a map")
    if raw.get("v") != VERSION:
        raise _fail(f"unsupported protocol version {raw.get('v')!r} (this agent speaks {VERSION})")
    kind = raw.get("t")
    if kind not in KINDS:
        raise _fail(f"unknown kind {kind!r}")
    message = Message(kind=kind, sender=_str(raw.get("from"), "from", 64), now_us=_uint(raw.get("now", 0), "now"))
    reach = raw.get("reach", {})
    if not isinstance(reach, Mapping):
        raise _fail("reach must be a map")
    for peer, age in reach.items():
        if type(age) not in (int, float) or not 0 <= age < 1e12:
            raise _fail("reach ages must be non-negative numbers")
        message.reach[_str(peer, "reach peer", 64)] = float(age)
    rules = _list(raw.get("rules", []), "rules")
    names: list[str] = []
    for item in rules:
        entry = _list(item, "rule entry")
        if len(entry) != 3:
            raise _fail("a rule entry is [name, window_us, resolution_us]")
        name = _str(entry[0], "rule name", 64)
        names.append(name)
        message.rules[name] = (_uint(entry[1], "rule window"), _uint(entry[2], "rule resolution"))
    slots = [_str(s, "slot id") for s in _list(raw.get("slots", []), "slots")]
    total = 0
    for item in _list(raw.get("keys", []), "keys"):
        entry = _list(item, "key entry")
        if len(entry) != 3:
            raise _fail("a key entry is [rule_index, subject, cells]")
        rule_i, subject, flat = entry
        if type(rule_i) is not int or not 0 <= rule_i < len(names):
            raise _fail(f"rule index {rule_i!r} out of range")
        if type(subject) is not bytes or len(subject) > 4096:
            raise _fail("a subject must be at most 4096 bytes of binary data")
        flat = _list(flat, "cells")
        if len(flat) % 4:
            raise _fail("cells must be a flat list of [bucket, slot, value, floor] quadruples")
        total += len(flat) // 4
        if total > max_cells:
            raise _fail(f"more than {max_cells} cells")
        rule = names[rule_i]
        for i in range(0, len(flat), 4):
            bucket, slot_i, value, floor = flat[i], flat[i + 1], flat[i + 2], flat[i + 3]
            if type(slot_i) is not int or not 0 <= slot_i < len(slots):
                raise _fail(f"slot index {slot_i!r} out of range")
            message.cells.append(
                (rule, subject, _uint(bucket, "bucket"), slots[slot_i], _uint(value, "value"), _uint(floor, "floor"))
            )
    digests = raw.get("digests", {})
    if not isinstance(digests, Mapping):
        raise _fail("digests must be a map")
    for part, digest in digests.items():
        message.digests[_uint(part, "partition")] = _uint(digest, "digest")
    message.want = [_uint(p, "wanted partition") for p in _list(raw.get("want", []), "want")]
    return message


def _list(value: object, what: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise _fail(f"{what} must be a list")
    return value


def group_cells(cells: Iterable[Cell6]) -> dict[tuple[str, bytes], list[tuple[int, str, int, int]]]:
    """Cells by (rule, subject)."""
    out: dict[tuple[str, bytes], list[tuple[int, str, int, int]]] = {}
    for rule, subject, bucket, slot, value, floor in cells:
        out.setdefault((rule, subject), []).append((bucket, slot, value, floor))
    return out

"""Escrow messages between agents (msgpack), with strict validation. No I/O.

They travel on their own endpoint, ``POST /v1/escrow``, signed like gossip
(:mod:`geolimit.replication.auth`). A body is a msgpack map::

    {"v": 1, "t": KIND, "from": REGION, "to": REGION, "shards": SHARDS,
     "rules": [[NAME, WINDOW_US, RESOLUTION_US], ...],   # the sender's escrow rules
     "keys": [[SUFFIX, [FIELD, VALUE, ...]], ...],       # SUFFIX: b"rule:subject"
     "cursor": [RULE_INDEX, NODE_INDEX, SCAN_CURSOR],    # pull: where to go on
     "holds": [[SHARD, SINCE_US], ...],                  # pull: the sender's hold starts
     "known": [SHARD, ...],                              # page: shards with another recorded start
     "done": true}                                       # page: the scan is complete

``holds`` gives, for each shard of the sender, the start of its last escrow
hold (a new or wiped Redis holds escrow rules back until restored) on the
sender's clock, which identifies that Redis's escrow state there. The responder
records the first start it sees per sender and shard, and answers in ``known``
the shards where it recorded another one. For a shard the sender holds now,
that means its Redis held escrow state there before and lost it: its
admissions of the last window may still count, and the hold lasts a window.
Sending every shard's start, not only the held ones, lets a responder that lost
its own records learn them again.

KIND is ``push`` (changed keys; answered by ``ack``) or ``pull`` (answered by a
``page`` of the responder's keys from ``cursor`` on). Field names and values are
checked by :func:`geolimit.store.escrow_fields.vet_fields` before anything
is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.errors import ProtocolError
from geolimit.replication.msgpack_bounds import unpack_bounded

__all__ = ["ESCROW_PATH", "KINDS", "MAX_KEYS", "EscrowMessage", "decode", "encode"]

ESCROW_PATH = "/v1/escrow"
VERSION = 1
KINDS = ("push", "pull", "ack", "page")
#: Keys one message may carry.
MAX_KEYS = 2000
#: Arrays and maps in one message: 2 per key, the rules and the holds stay far below (msgpack_bounds).
MAX_CONTAINERS = 1 << 16
_MAX_UINT = 2**63 - 1

Cursor = tuple[int, int, int]


@dataclass(slots=True)
class EscrowMessage:
    kind: str
    sender: str
    dest: str
    shards: int
    rules: dict[str, tuple[int, int]] = field(default_factory=dict)  # escrow rules: name -> (window_us, res_us)
    keys: list[tuple[bytes, list[Any]]] = field(default_factory=list)  # (rule:subject, [name, value, ...])
    cursor: Cursor | None = None
    done: bool = False
    holds: dict[int, int] = field(default_factory=dict)  # pull: shard -> last hold start (µs, sender's clock)
    known: list[int] = field(default_factory=list)  # page: shards whose recorded start differs


def encode(message: EscrowMessage) -> bytes:
    body: dict[str, Any] = {
        "v": VERSION, "t": message.kind, "from": message.sender, "to": message.dest, "shards": message.shards,
        "rules": [[n, w, r] for n, (w, r) in message.rules.items()],
        "keys": [[suffix, fields] for suffix, fields in message.keys],
    }
    if message.cursor is not None:
        body["cursor"] = list(message.cursor)
    if message.done:
        body["done"] = True
    if message.holds:
        body["holds"] = [[shard, since] for shard, since in sorted(message.holds.items())]
    if message.known:
        body["known"] = sorted(message.known)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"malformed escrow message: {what}")


def _uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_UINT:
        raise _fail(f"{what} must be an unsigned integer")
    return value


def _name(value: object, what: str) -> str:
    if type(value) is not str or not 0 < len(value) <= 64:
        raise _fail(f"{what} must be a name of 1 to 64 characters")
    return value


def decode(body: bytes) -> EscrowMessage:
    """Parse and check a message; any defect raises :class:`ProtocolError`."""
    try:
        raw = unpack_bounded(body, MAX_CONTAINERS, raw=False, strict_map_key=False, max_str_len=1 << 16,
                              max_bin_len=MAX_SUBJECT_BYTES + 200, max_array_len=1 << 16, max_map_len=64,
                              max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"escrow body is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise _fail(f"expected a map of version {VERSION}")
    kind = raw.get("t")
    if kind not in KINDS:
        raise _fail(f"unknown kind {str(kind)[:40]!r}")
    rules: dict[str, tuple[int, int]] = {}
    entries = raw.get("rules", [])
    if not isinstance(entries, list) or len(entries) > 1024:
        raise _fail("rules must be a list of at most 1024 entries")
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 3:
            raise _fail("a rule entry is [name, window_us, resolution_us]")
        rules[_name(entry[0], "rule name")] = (_uint(entry[1], "rule window"), _uint(entry[2], "rule resolution"))
    keys = raw.get("keys", [])
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise _fail(f"keys must be a list of at most {MAX_KEYS}")
    pairs: list[tuple[bytes, list[Any]]] = []
    for entry in keys:
        if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not bytes \
                or not isinstance(entry[1], list):
            raise _fail("a key entry is [rule:subject, [name, value, ...]]")
        pairs.append((entry[0], entry[1]))
    cursor = raw.get("cursor")
    if cursor is not None:
        if not isinstance(cursor, list) or len(cursor) != 3:
            raise _fail("cursor must be [rule index, node index, scan cursor]")
        cursor = (_uint(cursor[0], "cursor"), _uint(cursor[1], "cursor"), _uint(cursor[2], "cursor"))
    shards = _uint(raw.get("shards", 0), "shards")
    holds: dict[int, int] = {}
    entries = raw.get("holds", [])
    if not isinstance(entries, list) or len(entries) > shards:
        raise _fail("holds must be a list of at most one entry per shard")
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 2:
            raise _fail("a hold entry is [shard, since_us]")
        shard = _uint(entry[0], "hold shard")
        if shard >= shards or shard in holds:
            raise _fail("a hold names a shard out of range or twice")
        holds[shard] = _uint(entry[1], "hold start")
    known = raw.get("known", [])
    if not isinstance(known, list) or len(known) > shards:
        raise _fail("known must be a list of at most one entry per shard")
    known = [_uint(shard, "known shard") for shard in known]
    if any(shard >= shards for shard in known):
        raise _fail("known names a shard out of range")
    return EscrowMessage(
        kind=kind, sender=_name(raw.get("from"), "from"), dest=_name(raw.get("to"), "to"),
        shards=shards, rules=rules, keys=pairs, cursor=cursor,
        done=raw.get("done") is True, holds=holds, known=known,
    )

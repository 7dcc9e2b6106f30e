"""The gossip wire format (msgpack), with strict validation of the envelope. No I/O.

A message body is a msgpack map::

    {"v": 3, "t": KIND, "from": REGION, "to": REGION, "now": MICROSECONDS,
     "reach": {PEER: SECONDS_SINCE_LAST_ACK, ...},
     "failing": [PEER, ...],                      # peers the sender cannot reach right now
     "shards": SHARDS,                            # the sender's shard count (must match)
     "rules": [[NAME, WINDOW_US, RESOLUTION_US], ...],   # escrow rules: [..., 1]
     "blobs": [[SHARD, BLOB], ...],               # cells, packed by Redis (see below)
     "ae": {...}}                                 # one anti-entropy step (antientropy.py)

KIND is ``delta`` (changed cells), ``ae`` (a step of an anti-entropy exchange) or
``ack`` (every response). A BLOB is itself msgpack, built by ``pack.lua`` and read
by ``merge.lua`` inside Redis: ``[slots, keys, counts, cells]`` where ``keys`` are
``rule:subject``, ``counts[i]`` is the number of cells of ``keys[i]``, and ``cells``
one flat list of ``bucket, slot_ref, value, floor`` in key order (version 2 had a
cell list per key, which cost Redis's cmsgpack a table per key each way).
Python checks the envelope here; the receiver checks every cell of a blob
(``blob_check.py``, and ``merge.lua`` for what needs Redis state) before it
writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from geolimit.errors import ProtocolError
from geolimit.replication.msgpack_bounds import unpack_bounded

__all__ = ["KINDS", "Blob", "Cell6", "Message", "decode", "encode"]

VERSION = 3
KINDS = ("delta", "ae", "ack")
MAX_UINT = 2**63 - 1
MAX_BLOBS = 4096
#: Arrays and maps in one envelope: a message of MAX_BLOBS blobs, or an anti-entropy
#: step of 2048 entries, holds a few thousand (see msgpack_bounds).
MAX_CONTAINERS = 1 << 16
#: (rule, subject, bucket, slot id, value, floor)
Cell6 = tuple[str, bytes, int, str, int, int]
#: (shard, msgpack blob of cells)
Blob = tuple[int, bytes]


@dataclass(slots=True)
class Message:
    kind: str
    sender: str
    dest: str = ""
    now_us: int = 0
    reach: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)  # peers the sender currently cannot deliver to
    rules: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> Rule.structure
    shards: int = 0
    blobs: list[Blob] = field(default_factory=list)
    ae: dict[str, Any] = field(default_factory=dict)
    #: A delta from a region that cannot vouch for all its shards' changes now (one of its
    #: workers is down, ``geolimit agent --workers N``): its cells count, but the receiver
    #: does not take the region's counts as current from it (GossipEngine.peer_ages).
    partial: bool = False


def encode(message: Message) -> bytes:
    body: dict[str, Any] = {
        "v": VERSION,
        "t": message.kind,
        "from": message.sender,
        "to": message.dest,
        "now": message.now_us,
        "reach": message.reach,
        "failing": message.failing,
        "shards": message.shards,
        "rules": [[name, w, r, 1] if e else [name, w, r] for name, (w, r, e) in message.rules.items()],
    }
    if message.blobs:
        body["blobs"] = [[shard, blob] for shard, blob in message.blobs]
    if message.ae:
        body["ae"] = message.ae
    if message.partial:
        body["partial"] = True
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _fail(what: str) -> ProtocolError:
    return ProtocolError(f"malformed gossip message: {what}")


def _uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_UINT:
        raise _fail(f"{what} must be an unsigned integer, got {str(value)[:40]!r}")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise _fail(f"{what} must be true or false, got {str(value)[:40]!r}")
    return value


def _str(value: object, what: str, limit: int = 256, empty: bool = False) -> str:
    if type(value) is not str or (not value and not empty) or len(value) > limit:
        raise _fail(f"{what} must be a {'' if empty else 'non-empty '}string of at most {limit} characters")
    return value


def decode(body: bytes, max_blob_bytes: int = 1 << 24) -> Message:
    """Parse and validate a message envelope; any defect raises :class:`ProtocolError`."""
    raw = _unpack(body, max_blob_bytes)
    kind = raw.get("t")
    if kind not in KINDS:
        raise _fail(f"unknown kind {str(kind)[:40]!r}")
    return Message(
        kind=kind,
        sender=_str(raw.get("from"), "from", 64),
        dest=_str(raw.get("to", ""), "to", 64, empty=True),
        now_us=_uint(raw.get("now", 0), "now"),
        reach=_reach(raw.get("reach", {})),
        failing=_failing(raw.get("failing", [])),
        rules=_rules(raw.get("rules", [])),
        shards=_uint(raw.get("shards", 0), "shards"),
        blobs=_blobs(raw.get("blobs", [])),
        ae=_ae(raw.get("ae", {})),
        partial=_bool(raw.get("partial", False), "partial"),
    )


def _unpack(body: bytes, max_blob_bytes: int) -> dict[Any, Any]:
    """The body as a map of this protocol version, each msgpack object within size limits."""
    try:
        raw = unpack_bounded(
            body,
            MAX_CONTAINERS,
            raw=False,
            strict_map_key=False,
            max_str_len=1 << 16,
            max_bin_len=max_blob_bytes,
            max_array_len=1 << 16,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"gossip body is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict):
        raise _fail("the body must be a map")
    if raw.get("v") != VERSION:
        raise _fail(f"unsupported protocol version {str(raw.get('v'))[:20]!r} (this agent speaks {VERSION})")
    return raw


def _reach(value: object) -> dict[str, float]:
    if not isinstance(value, Mapping) or len(value) > 256:
        raise _fail("reach must be a map of at most 256 peers")
    reach: dict[str, float] = {}
    for peer, age in value.items():
        if type(age) not in (int, float) or not 0 <= age < 1e12:
            raise _fail("reach ages must be non-negative numbers")
        reach[_str(peer, "reach peer", 64)] = float(age)
    return reach


def _failing(value: object) -> list[str]:
    failing = _list(value, "failing")
    if len(failing) > 256:
        raise _fail("more than 256 failing peers")
    return [_str(p, "failing peer", 64) for p in failing]


def _rules(value: object) -> dict[str, tuple[int, int, int]]:
    entries = _list(value, "rules")
    if len(entries) > 1024:
        raise _fail("more than 1024 rules")
    rules: dict[str, tuple[int, int, int]] = {}
    for item in entries:
        entry = _list(item, "rule entry")
        if len(entry) not in (3, 4) or (len(entry) == 4 and entry[3] != 1):
            raise _fail("a rule entry is [name, window_us, resolution_us] (and 1 for an escrow rule)")
        rules[_str(entry[0], "rule name", 64)] = (
            _uint(entry[1], "rule window"), _uint(entry[2], "rule resolution"), 1 if len(entry) == 4 else 0,
        )
    return rules


def _blobs(value: object) -> list[Blob]:
    entries = _list(value, "blobs")
    if len(entries) > MAX_BLOBS:
        raise _fail(f"more than {MAX_BLOBS} blobs")
    blobs: list[Blob] = []
    for item in entries:
        entry = _list(item, "blob entry")
        if len(entry) != 2 or type(entry[1]) is not bytes:
            raise _fail("a blob entry is [shard, bytes]")
        blobs.append((_uint(entry[0], "blob shard"), entry[1]))
    return blobs


def _ae(value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(type(k) is str for k in value):
        raise _fail("ae must be a map with string keys")
    return value


def _list(value: object, what: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise _fail(f"{what} must be a list")
    return value

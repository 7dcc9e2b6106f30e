"""Read a region's replication queues straight from Redis (tests only).

Per shard (``tag`` = ``<prefix>:{<shard>}``) and peer P, see geolimit/store/lua/outbox.lua:

    tag#c       data key -> entry   changed since the last drain (for every peer)
    tag#o:P     data key -> entry   P's outbox
    tag#f:P:w   in-flight slot w:   '#<n>' -> msgpack [key, entry, ...] per pack call
                                    (or, for a whole outbox renamed, data key -> entry),
                                    and '@t' -> when its oldest entry was queued

An entry is a bucket ``b`` (this region's own cells from ``b`` on) or ``-(b + 1)``
(every slot's cells from ``b`` on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from geolimit.core.keys import KeyLayout

__all__ = ["Entry", "Queued", "decode_entry", "flight_entries", "queue_key_names", "queued_entries"]

Entry = tuple[int, bool]  # first bucket, every slot (else only the region's own slot)
Queued = dict[str, dict[tuple[str, bytes], list[Entry]]]  # peer -> (rule, subject) -> entries


def decode_entry(raw: bytes | str | int) -> Entry:
    value = int(raw)
    return (-value - 1, True) if value < 0 else (value, False)


def flight_entries(fields: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """``(data key, raw entry)`` of an in-flight hash, in either layout."""
    out: list[tuple[bytes, bytes]] = []
    for name, value in fields.items():
        if name == b"@t":
            continue
        if name.startswith(b"#"):
            flat: list[Any] = msgpack.unpackb(value, raw=True)
            out += [(bytes(flat[i]), bytes(flat[i + 1])) for i in range(0, len(flat), 2)]
        else:
            out.append((name, value))
    return out


def queue_key_names(layout: KeyLayout, peers: Sequence[str], window: int) -> list[tuple[str | None, str, bytes]]:
    """``(peer or None for every peer, kind 'c'|'o'|'f', hash name)`` of every queue."""
    names: list[tuple[str | None, str, bytes]] = []
    for shard in range(layout.shards):
        tag = layout.tag(shard)
        names.append((None, "c", tag + b"#c"))
        for peer in peers:
            names.append((peer, "o", tag + b"#o:" + peer.encode()))
            names += [(peer, "f", tag + b"#f:%b:%d" % (peer.encode(), w)) for w in range(window)]
    return names


def queued_entries(
    layout: KeyLayout, peers: Sequence[str], names: Sequence[tuple[str | None, str, bytes]],
    hashes: Iterable[dict[bytes, bytes]],
) -> Queued:
    """Every entry still to be sent to each peer, from the HGETALLs of ``names``."""
    out: Queued = {p: {} for p in peers}
    for (owner, kind, _), fields in zip(names, hashes, strict=True):
        pairs = flight_entries(fields) if kind == "f" else list(fields.items())
        for key, raw in pairs:
            _, rule, subject = layout.parse_data_key(key)
            for peer in peers if owner is None else (owner,):
                out[peer].setdefault((rule, subject), []).append(decode_entry(raw))
    return out

"""What the replication store's scripts return and the bounds they work within.

:class:`Limits` bounds every script call and what a peer may send; :class:`Drained`,
:class:`Packed` and :class:`MergeResult` are the replies of ``drain.lua``,
``pack.lua`` and ``merge.lua`` as :class:`~geolimit.replication.redis_io.ReplicationStore`
returns them; :class:`JunkKeys` counts the junk keys its other scripts deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from geolimit.replication.wire import Blob

__all__ = ["Drained", "JunkKeys", "Limits", "MergeResult", "Packed"]

log = logging.getLogger("geolimit.gossip")


@dataclass(frozen=True)
class Limits:
    """Bounds on script work and on what a peer may send."""

    drain_keys: int = 1000  # changed keys one drain call fans out
    pack_keys: int = 2048  # outbox keys one pack call takes (pack_cells bounds the work too)
    pack_cells: int = 2048  # cells one pack call puts in a blob
    blob_cells: int = 4096  # cells a peer's blob may hold
    new_slots: int = 16  # slot ids a blob may add to a shard's registry
    max_slots: int = 256  # slot ids a shard's registry may hold
    park_cells: int = 10_000  # cells ahead of the skew tolerance a shard keeps until their bucket comes
    park_seconds: float = 60.0  # how far past the tolerance a cell may be and still be parked
    unpark_cells: int = 1000  # parked cells one unpark call takes


@dataclass(slots=True)
class Drained:
    own_slots: dict[int, str] = field(default_factory=dict)  # shard -> this region's slot id
    changed_left: int = 0  # changed keys not yet fanned out (more than one call's worth)
    taken: int = 0  # changed keys fanned out by this drain
    pending: dict[str, dict[int, int]] = field(default_factory=dict)  # peer -> shard -> outbox keys
    oldest_us: dict[str, int | None] = field(default_factory=dict)  # peer -> oldest queued change
    #: Keys of the shards' bookkeeping that held another type (junk, drain.lua): deleted and rewritten.
    junk: int = 0
    #: Shards whose call failed (a Redis Cluster node down): drained next round.
    failed: dict[int, str] = field(default_factory=dict)  # shard -> the error


@dataclass(slots=True)
class Packed:
    blobs: list[Blob] = field(default_factory=list)
    shards: dict[int, int] = field(default_factory=dict)  # shard -> keys it put in flight
    keys: int = 0
    cells: int = 0
    left: dict[int, int] = field(default_factory=dict)  # shard -> outbox keys still queued
    unknown: int = 0  # outbox keys of rules this agent does not know (dropped)
    bad: int = 0  # stored values that were not exact integers (skipped)
    queued_us: int | None = None  # when the oldest change it put in flight was queued (µs, Redis clock)


#: The counters of an accepted merge.lua reply, in order (after the leading 1).
_MERGE_FIELDS = ("cells", "increased", "dropped_old", "dropped_future", "unknown_rule", "relayed", "own_ahead", "parked")


@dataclass(slots=True)
class MergeResult:
    cells: int = 0
    increased: int = 0
    dropped_old: int = 0
    dropped_future: int = 0
    unknown_rule: int = 0
    relayed: int = 0  # (key, peer) pairs queued for relay
    own_ahead: int = 0  # repair mode: cells claiming more in this region's own slot (skipped)
    parked: int = 0  # cells ahead of the skew tolerance, kept until their bucket comes (unpark)

    def add(self, reply: Sequence[Any]) -> None:
        """Add one accepted ``merge.lua`` reply (``{1, cells, ...}``; later fields may be absent)."""
        for name, value in zip(_MERGE_FIELDS, reply[1:], strict=False):
            setattr(self, name, getattr(self, name) + int(value))


class JunkKeys:
    """Bookkeeping keys of another type (junk) that ``pack.lua``, ``settle.lua``,
    ``merge.lua`` and ``unpark.lua`` deleted (in-flight slots ``#f:``, parking keys
    ``#pk`` / ``#pz``): each logged with its name, and counted until the engine takes
    the count into its ``junk_keys`` stat (``drain.lua``'s go there through :class:`Drained`)."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._count = 0

    def note(self, shard: int, keys: Sequence[bytes], script: str) -> None:
        """``script``'s call on ``shard`` deleted ``keys`` (they held another type)."""
        if not keys:
            return
        self._count += len(keys)
        names = b", ".join(bytes(k) for k in keys).decode(errors="replace")
        log.warning("region %s: shard %d: %s held another type (junk): deleted by %s.lua",
                    self.region, shard, names, script)

    def take(self) -> int:
        """The keys noted since the last call."""
        count, self._count = self._count, 0
        return count

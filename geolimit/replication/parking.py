"""Cells further ahead than the clock-skew tolerance, kept until their bucket comes.

``merge.lua`` parks a peer's cell whose bucket is after ``c + F`` (the tolerance)
and at most ``Limits.park_seconds`` past it, up to ``Limits.park_cells`` per shard,
in the shard's hash ``<tag>#pk`` (due times in zset ``<tag>#pz``), instead of
dropping it. Each round the engine asks the shards whose first parked cell is
due (:attr:`ParkedCells.due`, learnt from merges and, at start, from Redis) for
those cells (``unpark.lua``, bounded) and merges them like a peer's: checked,
max-merged, and relayed to the peers that some peer currently reports it cannot
reach (who sent a parked cell is not kept; a relay is a max-merge, so relaying
to more peers than the source could not reach only duplicates).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from geolimit.errors import ProtocolError, StorageError
from geolimit.replication.blob_format import pack_blob
from geolimit.store.async_store import checked_replies
from geolimit.store.scripts import load_script

if TYPE_CHECKING:
    from geolimit.replication.redis_io import ReplicationStore

__all__ = ["ParkedCells", "parked_blob"]

log = logging.getLogger("geolimit.gossip")

_UNPARK = load_script("unpark")


class ParkedCells:
    """The parked cells of a :class:`~geolimit.replication.redis_io.ReplicationStore`'s owned shards."""

    def __init__(self, store: ReplicationStore) -> None:
        self.store = store
        #: Shards holding parked cells -> the first one's due time (µs, region clock).
        self.due: dict[int, int] = {}

    def note(self, shard: int, due_us: int) -> None:
        """A merge parked cells in ``shard``, the first due at ``due_us``."""
        old = self.due.get(shard)
        if old is None or due_us < old:
            self.due[shard] = due_us

    async def release(self, now_us: int, relay_to: Sequence[str] = ()) -> int:
        """Merge the parked cells that are due (``now_us``: the region clock), queueing them
        for the peers in ``relay_to``; returns the cells merged.

        Bounded: one call per due shard takes at most ``limits.unpark_cells``; the
        rest waits for the next round.
        """
        store = self.store
        owned = set(store.owned)
        due = sorted(s for s, t in self.due.items() if t <= now_us and s in owned)
        if not due:
            return 0
        calls = [[b"1", store.layout.registry_key(s), store.clock_arg(), b"%d" % store.limits.unpark_cells] for s in due]
        blobs: list[tuple[int, bytes]] = []
        for shard, reply in zip(due, checked_replies(await store.store.run_many(_UNPARK, calls)), strict=True):
            cells = self._cells(shard, reply)
            nxt = int(reply[0])
            if nxt >= 0:
                self.due[shard] = nxt
            else:
                self.due.pop(shard, None)
            if cells:
                blobs.append((shard, parked_blob(cells)))
        merged = 0
        for blob in blobs:  # out of parking now: each is merged (or given up) on its own
            for attempt in (1, 2):
                try:
                    merged += (await store.merge_blobs([blob], store.region, relay_to)).cells
                    break
                except ProtocolError as exc:  # e.g. the slot registry filled up meanwhile
                    log.warning("region %s: parked cells of shard %d could not be merged: %s",
                                store.region, blob[0], exc)
                    break
                except StorageError as exc:  # a concurrent merge changed the registry; Redis away
                    if attempt == 2:
                        log.warning("region %s: parked cells of shard %d could not be merged (anti-entropy "
                                    "repairs them from the peers): %s", store.region, blob[0], exc)
        return merged

    async def find(self) -> None:
        """Learn which owned shards hold parked cells (at start: :attr:`due` lives in memory)."""
        store = self.store
        calls = [[b"1", store.layout.registry_key(s), store.clock_arg(), b"0"] for s in store.owned]
        for shard, reply in zip(store.owned, checked_replies(await store.store.run_many(_UNPARK, calls)), strict=True):
            self._cells(shard, reply)
            if int(reply[0]) >= 0:
                self.note(shard, int(reply[0]))

    def _cells(self, shard: int, reply: Sequence[Any]) -> Sequence[bytes]:
        """The field, value pairs of an ``unpark.lua`` reply; parking keys of another type
        (junk) it deleted (the reply's last item, then) are noted."""
        if len(reply) % 2 == 0:
            self.store.junk.note(shard, reply[-1], "unpark")
            return reply[1:-1]
        return reply[1:]


def parked_blob(flat: Sequence[bytes]) -> bytes:
    """A merge blob of ``unpark.lua``'s field, value pairs (fields it cannot read are skipped)."""
    slots: dict[bytes, int] = {}
    by_key: dict[bytes, list[int]] = {}
    for i in range(0, len(flat) - 1, 2):
        field, value = bytes(flat[i]), bytes(flat[i + 1])
        try:
            bucket_s, length_s, rest = field.split(b":", 2)
            length = int(length_s)
            slot, suffix = rest[:length], rest[length:]
            v_s, w_s = value.split(b":")
            bucket, v, w = int(bucket_s), int(v_s), int(w_s)
        except ValueError:
            continue
        if len(slot) != length or not suffix:
            continue
        ref = slots.setdefault(slot, len(slots))
        by_key.setdefault(suffix, []).extend((bucket, ref, v, w))
    cells = [x for group in by_key.values() for x in group]
    return pack_blob(list(slots), list(by_key), [len(g) // 4 for g in by_key.values()], cells)



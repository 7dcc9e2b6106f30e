"""Per-peer outboxes: replicated cells waiting for an acknowledgement.

An outbox holds at most one entry per (rule, subject, bucket, slot), merged by
``max``, so it stays bounded by the number of live cells however long a peer is
unreachable: a cell's later increments overwrite its pending value instead of
queueing behind it. Entries for buckets that have left every window are pruned
(they can no longer change any decision). Sending takes a snapshot; an
acknowledgement removes only the entries that have not grown since.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CellKey", "Outbox", "Pending"]

#: (rule, subject, bucket, slot id)
CellKey = tuple[str, bytes, int, str]


@dataclass(slots=True)
class Pending:
    value: int
    floor: int
    since: float  # when the oldest unacknowledged change of this cell was queued


class Outbox:
    """Cells to send to one peer."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self._cells: dict[CellKey, Pending] = {}
        self.overflowed = 0  # cells refused because the outbox was full

    def __len__(self) -> int:
        return len(self._cells)

    def add(self, key: CellKey, value: int, floor: int, now: float) -> None:
        have = self._cells.get(key)
        if have is None:
            if len(self._cells) >= self.limit:
                self.overflowed += 1
                return
            self._cells[key] = Pending(value, floor, now)
            return
        if value > have.value:
            have.value = value
        if floor > have.floor:
            have.floor = floor

    def extend(self, cells: Iterable[tuple[CellKey, int, int]], now: float) -> None:
        for key, value, floor in cells:
            self.add(key, value, floor, now)

    def snapshot(self, limit: int | None = None) -> list[tuple[CellKey, int, int]]:
        """Up to ``limit`` cells to send now, oldest first."""
        out: list[tuple[CellKey, int, int]] = []
        for key, pending in self._cells.items():
            out.append((key, pending.value, pending.floor))
            if limit is not None and len(out) >= limit:
                break
        return out

    def ack(self, sent: Iterable[tuple[CellKey, int, int]]) -> int:
        """Drop cells the peer now has; a cell that grew since it was sent stays."""
        removed = 0
        for key, value, floor in sent:
            have = self._cells.get(key)
            if have is not None and have.value <= value and have.floor <= floor:
                del self._cells[key]
                removed += 1
        return removed

    def prune(self, expired: Callable[[CellKey], bool]) -> int:
        """Drop cells for which ``expired(key)`` is true; returns how many."""
        dead = [key for key in self._cells if expired(key)]
        for key in dead:
            del self._cells[key]
        return len(dead)

    def oldest(self) -> float | None:
        """When the oldest pending change was queued (None when empty)."""
        # Insertion order is queueing order and ``since`` never changes.
        for pending in self._cells.values():
            return pending.since
        return None

    def clear(self) -> None:
        self._cells.clear()

"""G-counter slots with reset floors: the replicated state of one key.

Every bucket of a key holds one *cell* per slot, a slot being one incarnation
of one region (``"us-east/18c2f3a1b2c3d"``). A region only ever increments its
own slot's value. A reset records, per slot, a *floor*: the value that slot had
when the reset was observed. Both are merged with ``max``, so the state is a
join semilattice: merging is idempotent, commutative and associative, and any
order or duplication of messages converges to the same state.

Values and floors are stored as ``count * SUBSTEPS + first`` (see
:mod:`geolimit.core.window`); the count a slot contributes is
``max(0, count(value) - count(floor))`` and a bucket's count is the sum over its slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from geolimit.core.window import SUBSTEPS

__all__ = [
    "Cell",
    "KeyState",
    "effective",
    "join",
    "join_cell",
    "parse_slot_id",
    "per_bucket_totals",
    "slot_id",
]

#: ``{bucket: {slot_id: Cell}}``
KeyState = dict[int, dict[str, "Cell"]]


@dataclass(frozen=True, slots=True)
class Cell:
    """One slot's counter in one bucket."""

    value: int = 0
    floor: int = 0

    @property
    def effective(self) -> int:
        count, floor = self.value // SUBSTEPS, self.floor // SUBSTEPS
        return count - floor if count > floor else 0


def slot_id(region: str, incarnation: str) -> str:
    """The identity of a G-counter slot."""
    return f"{region}/{incarnation}"


def parse_slot_id(slot: str) -> tuple[str, str]:
    """Split a slot id into ``(region, incarnation)``."""
    region, sep, incarnation = slot.rpartition("/")
    if not sep or not region or not incarnation:
        raise ValueError(f"invalid slot id {slot!r}: expected 'region/incarnation'")
    return region, incarnation


def join_cell(a: Cell, b: Cell) -> Cell:
    """The least upper bound of two cells."""
    if a.value >= b.value and a.floor >= b.floor:
        return a
    if b.value >= a.value and b.floor >= a.floor:
        return b
    return Cell(max(a.value, b.value), max(a.floor, b.floor))


def join(a: Mapping[int, Mapping[str, Cell]], b: Mapping[int, Mapping[str, Cell]]) -> KeyState:
    """The least upper bound of two key states (a new state; inputs are untouched)."""
    out: KeyState = {bucket: dict(slots) for bucket, slots in a.items()}
    for bucket, slots in b.items():
        mine = out.setdefault(bucket, {})
        for slot, cell in slots.items():
            have = mine.get(slot)
            mine[slot] = cell if have is None else join_cell(have, cell)
    return out


def effective(slots: Mapping[str, Cell]) -> int:
    """A bucket's count: the sum of its slots' effective values."""
    return sum(cell.effective for cell in slots.values())


def per_bucket_totals(
    state: Mapping[int, Mapping[str, Cell]], buckets: Iterable[int] | None = None
) -> dict[int, int]:
    """``{bucket: count}`` for every bucket (or the given ones) of a key state."""
    chosen = state.keys() if buckets is None else buckets
    return {b: effective(state.get(b, {})) for b in chosen}

"""A pure, in-memory model of one region's store: what the Lua scripts do.

It keeps every key as a :data:`~geolimit.core.gcounter.KeyState` and decides with
:func:`~geolimit.core.window.evaluate`, so the Lua scripts can be tested against
it and a whole multi-region cluster can be simulated without Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from geolimit.core.gcounter import Cell, KeyState, effective, join, slot_id
from geolimit.core.rule import Rule
from geolimit.core.window import Evaluation, bucket_of, evaluate, window_sums

__all__ = ["ModelStore"]


@dataclass
class ModelStore:
    """One region's keys. ``incarnation`` names this region's own slot."""

    region: str
    incarnation: str = "0"
    keys: dict[tuple[str, bytes], KeyState] = field(default_factory=dict)

    @property
    def own_slot(self) -> str:
        return slot_id(self.region, self.incarnation)

    def sums(self, rule: Rule, subject: bytes, now_us: int) -> tuple[list[int], dict[int, int]]:
        state = self.keys.get((rule.name, subject), {})
        current = bucket_of(now_us, rule.resolution_us)
        low = current - rule.buckets
        high = current + rule.future
        totals = {b: effective(slots) for b, slots in state.items() if low <= b <= high}
        return window_sums(totals, current, rule.buckets)

    def hit(
        self,
        rules: Sequence[Rule],
        subject: bytes,
        cost: int,
        now_us: int,
        consume: bool = True,
    ) -> list[Evaluation]:
        """All-or-nothing over ``rules``; the same outcome as ``hit.lua``."""
        windows = [self.sums(rule, subject, now_us) for rule in rules]
        admitted = all(
            evaluate(s, f, now_us, cost, r.limit, r.resolution_us, r.mode == "approximate", False).allowed
            for r, (s, f) in zip(rules, windows, strict=True)
        )
        consumed = admitted and consume
        if consumed and cost > 0:
            for rule in rules:
                state = self.keys.setdefault((rule.name, subject), {})
                bucket = bucket_of(now_us, rule.resolution_us)
                cell = state.setdefault(bucket, {}).get(self.own_slot, Cell())
                state[bucket][self.own_slot] = Cell(cell.value + cost, cell.floor)
        return [
            evaluate(s, f, now_us, cost, r.limit, r.resolution_us, r.mode == "approximate", consumed)
            for r, (s, f) in zip(rules, windows, strict=True)
        ]

    def reset(self, rules: Sequence[Rule], subject: bytes, now_us: int) -> None:
        """Raise every live slot's floor to its value (``reset.lua``)."""
        for rule in rules:
            state = self.keys.get((rule.name, subject))
            if not state:
                continue
            oldest = bucket_of(now_us, rule.resolution_us) - rule.buckets
            for bucket, slots in state.items():
                if bucket >= oldest:
                    for slot, cell in slots.items():
                        slots[slot] = Cell(cell.value, max(cell.floor, cell.value))

    def merge(self, rule: str, subject: bytes, other: KeyState) -> None:
        """Join a replicated key state into this region's copy."""
        key = (rule, subject)
        self.keys[key] = join(self.keys.get(key, {}), other)

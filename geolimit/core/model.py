"""A pure, in-memory model of one region's store: what the Lua scripts do.

It keeps every key as a :data:`~geolimit.core.gcounter.KeyState` and decides with
:func:`~geolimit.core.window.evaluate`, so the Lua scripts can be tested against
it and a whole multi-region cluster can be simulated without Redis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from geolimit.core.gcounter import Cell, KeyState, effective, join, parse_slot_id, slot_id
from geolimit.core.policy import (
    Quanta,
    Reservation,
    Rise,
    Window,
    freeing,
    intake,
    predicted_retry,
    quanta_add,
    quantum_us,
    reserve,
)
from geolimit.core.rule import Rule
from geolimit.core.window import (
    SUBSTEPS,
    Evaluation,
    bucket_of,
    evaluate,
    first_offset,
    oldest_part,
    share,
    window_sums,
)

__all__ = ["ModelStore"]


@dataclass
class ModelStore:
    """One region's keys. ``incarnation`` names this region's own slot."""

    region: str
    incarnation: str = "0"
    keys: dict[tuple[str, bytes], KeyState] = field(default_factory=dict)
    #: peer region -> when its counts were last current (what the agent publishes)
    peer_known: dict[str, int] = field(default_factory=dict)
    regions: int = 1
    #: (rule, subject) -> slot id -> the last update of that slot that raised the key (``merge.lua``'s 'p' fields)
    rises: dict[tuple[str, bytes], dict[str, Rise]] = field(default_factory=dict)
    #: (rule, subject) -> this region's own recent admissions (``hit.lua``'s field 'u')
    quanta: dict[tuple[str, bytes], Quanta] = field(default_factory=dict)

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

    def firsts(self, rule: Rule, subject: bytes, now_us: int) -> list[int]:
        """Earliest first-admission offset of each bucket of the window (``firsts[d]``)."""
        state = self.keys.get((rule.name, subject), {})
        current = bucket_of(now_us, rule.resolution_us)
        out = [SUBSTEPS] * (rule.buckets + 1)
        for bucket, slots in state.items():
            delta = current - bucket
            if 0 <= delta <= rule.buckets:
                for cell in slots.values():
                    if cell.value:
                        out[delta] = min(out[delta], cell.value % SUBSTEPS)
        return out

    def reservation(self, rule: Rule, subject: bytes, now_us: int) -> Reservation:
        """Units set aside for peers, and whether policy ``closed`` denies."""
        if not (rule.predict or rule.partition != "local"):
            return Reservation(0.0, False)
        state = self.keys.get((rule.name, subject), {})
        current = bucket_of(now_us, rule.resolution_us)
        counts: dict[str, int] = {}
        for bucket, slots in state.items():
            delta = current - bucket
            if not 0 <= delta <= rule.buckets:
                continue
            for slot, cell in slots.items():
                region = parse_slot_id(slot)[0]
                if region == self.region:
                    continue
                counts[region] = counts.get(region, 0) + cell.effective
        rises: dict[str, list[Rise]] = {}
        for slot, rise in self.rises.get((rule.name, subject), {}).items():
            region = parse_slot_id(slot)[0]
            if region != self.region:
                rises.setdefault(region, []).append(rise)
        window: Window | None = None
        if rule.mode == "approximate":
            sums, _ = self.sums(rule, subject, now_us)
            n, res = rule.buckets, rule.resolution_us
            first = self.firsts(rule, subject, now_us)[n]
            weighted = sum(sums[:n]) + oldest_part(sums[n], share(first, current, res, now_us))
            window = Window(weighted, sum(sums), freeing(sums[n], first, res), intake(sums, now_us, res))
        found = reserve(
            limit=rule.limit, now_us=now_us, counts=counts, rises=rises, known_until=self.peer_known, regions=self.regions, predict=rule.predict,
            partition=rule.partition, partition_after_us=rule.partition_after_us,
            window=window, own=self.quanta.get((rule.name, subject)),
        )
        return found

    def peered(self, rule: Rule, subject: bytes, now_us: int) -> bool:
        """Does ``hit.lua`` look at the peers for this rule (a policy other than local, or
        another slot's count in the window, or a peer's rise), and record own admissions?"""
        if not (rule.predict or rule.partition != "local"):
            return False
        if rule.partition != "local" or self.rises.get((rule.name, subject)):
            return True
        current = bucket_of(now_us, rule.resolution_us)
        state = self.keys.get((rule.name, subject), {})
        return any(
            slot != self.own_slot and cell.value > 0
            for bucket, slots in state.items() if 0 <= current - bucket <= rule.buckets
            for slot, cell in slots.items()
        )

    def reserve_falls_at(self, rule: Rule, subject: bytes, now_us: int) -> int | None:
        """The earliest time the reserve may shrink with no news from the peers, or None
        (``hit.lua``: ``reservation()``'s fifth value; :attr:`Reservation.falls_at_us`)."""
        return self.reservation(rule, subject, now_us).falls_at_us

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
        held = [self.reservation(rule, subject, now_us) for rule in rules]
        firsts = [self.firsts(rule, subject, now_us) for rule in rules]
        peered = [self.peered(rule, subject, now_us) for rule in rules]
        admitted = all(
            not h.closed
            and evaluate(s, f, now_us, cost, r.limit, r.resolution_us, r.mode == "approximate", False, h.units, fs).allowed
            for r, (s, f), h, fs in zip(rules, windows, held, firsts, strict=True)
        )
        consumed = admitted and consume
        if consumed and cost > 0:
            for rule, seen in zip(rules, peered, strict=True):
                key = (rule.name, subject)
                if seen and rule.predict and rule.mode == "approximate":
                    self.quanta[key] = quanta_add(self.quanta.get(key), now_us, quantum_us(rule.partition_after_us), cost)
                state = self.keys.setdefault((rule.name, subject), {})
                bucket = bucket_of(now_us, rule.resolution_us)
                cell = state.setdefault(bucket, {}).get(self.own_slot, Cell())
                value = cell.value or first_offset(now_us, rule.resolution_us)
                state[bucket][self.own_slot] = Cell(value + cost * SUBSTEPS, cell.floor)
        out = []
        for r, (s, f), h, fs in zip(rules, windows, held, firsts, strict=True):
            approx = r.mode == "approximate"
            result = evaluate(s, f, now_us, cost, r.limit, r.resolution_us, approx, consumed, h.units, fs)
            if h.predicted > 0 and result.retry_after_us > 0:
                plain = evaluate(s, f, now_us, cost, r.limit, r.resolution_us, approx, False, h.units - h.predicted, fs)
                retry = predicted_retry(result.retry_after_us, plain.retry_after_us, h.predicted_until_us, now_us)
                result = dataclasses.replace(result, retry_after_us=retry)
            if h.closed:
                result = Evaluation(False, result.used, r.resolution_us, result.reset_after_us, result.stable_us)
            falls = h.falls_at_us
            if falls is not None and falls - now_us < result.stable_us:
                result = dataclasses.replace(result, stable_us=falls - now_us)
            out.append(result)
        return out

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

    def merge(self, rule: str, subject: bytes, other: KeyState, now_us: int | None = None, gap_us: int = 0) -> None:
        """Join a replicated key state into this region's copy.

        An update of a peer (``now_us``: when it is merged; ``gap_us`` > 0: the time
        since that peer's previous update) records, per peer slot whose count rose,
        a :class:`Rise` for prediction, as ``merge.lua`` does for deltas: per cell whose
        value rose, what its count rose by with floors applied (a value that its floor
        covers admitted nothing here). (Unlike ``merge.lua``, cells outside the rule's
        window count too.)
        """
        key = (rule, subject)
        old = self.keys.get(key, {})
        if now_us is not None and gap_us > 0:
            rose: dict[str, int] = {}
            for bucket, slots in other.items():
                for slot, cell in slots.items():
                    before = old.get(bucket, {}).get(slot, Cell())
                    if cell.value > before.value and parse_slot_id(slot)[0] != self.region:
                        after = Cell(cell.value, max(cell.floor, before.floor))
                        gained = after.effective - before.effective
                        if gained > 0:
                            rose[slot] = rose.get(slot, 0) + gained
            for slot, units in rose.items():
                if units > 0:
                    self.rises.setdefault(key, {})[slot] = Rise(now_us, units, gap_us)
        self.keys[key] = join(old, other)

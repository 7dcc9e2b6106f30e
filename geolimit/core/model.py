"""A pure, in-memory model of one region's store: what the Lua scripts do.

It keeps every key as a :data:`~geolimit.core.gcounter.KeyState` and decides with
:func:`~geolimit.core.window.evaluate`, so the Lua scripts can be tested against
it and a whole multi-region cluster can be simulated without Redis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from geolimit.core.gcounter import Cell, KeyState, effective, join, parse_slot_id, slot_id
from geolimit.core.policy import Reservation, predicted_retry, reserve
from geolimit.core.rule import Rule
from geolimit.core.window import (
    SUBSTEPS,
    Evaluation,
    bucket_of,
    evaluate,
    first_offset,
    window_sums,
)

__all__ = ["ModelStore", "reserve_falls_at"]


def reserve_falls_at(
    known_until: Mapping[str, int], recent: Mapping[str, int], own_region: str, now_us: int, resolution_us: int,
    partition_after_us: int,
) -> int | None:
    """When a reserve predicted for peers (``Rule.predict``) may first shrink with no news from them.

    A peer is predicted for while its counts are stale but at most
    ``partition_after`` old, at ``rate * staleness``, which only grows within a
    bucket; but its rate is recomputed at every bucket boundary (from counts
    that may have left buckets ``c-1`` and ``c``), and 1 us after its counts are
    ``partition_after`` old its prediction ends (replaced by nothing, the
    ``share`` policy's fair share, or a ``closed`` denial). So with a peer whose
    prediction is above 0 (it has counts in ``c-1`` or ``c``), the reserve may
    shrink at the next bucket boundary or at the first such end, whichever
    comes first; None if no peer is predicted for. ``recent``: each peer
    region's count in buckets ``c-1`` and ``c``.
    """
    at: int | None = None
    for region, until in known_until.items():
        stale = now_us - until
        if region != own_region and recent.get(region, 0) > 0 and 0 < stale <= partition_after_us:
            end = until + partition_after_us + 1
            at = end if at is None or end < at else at
    if at is None:
        return None
    edge = (now_us // resolution_us + 1) * resolution_us
    return edge if edge < at else at


@dataclass
class ModelStore:
    """One region's keys. ``incarnation`` names this region's own slot."""

    region: str
    incarnation: str = "0"
    keys: dict[tuple[str, bytes], KeyState] = field(default_factory=dict)
    #: peer region -> when its counts were last current (what the agent publishes)
    peer_known: dict[str, int] = field(default_factory=dict)
    regions: int = 1

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

    def _peer_counts(
        self, rule: Rule, subject: bytes, now_us: int
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Each peer region's count in the window, in buckets ``c-1`` and ``c``, and in ``c``."""
        state = self.keys.get((rule.name, subject), {})
        current = bucket_of(now_us, rule.resolution_us)
        counts: dict[str, int] = {}
        recent: dict[str, int] = {}
        latest: dict[str, int] = {}
        for bucket, slots in state.items():
            delta = current - bucket
            if not 0 <= delta <= rule.buckets:
                continue
            for slot, cell in slots.items():
                region = parse_slot_id(slot)[0]
                if region == self.region:
                    continue
                counts[region] = counts.get(region, 0) + cell.effective
                if delta <= 1:
                    recent[region] = recent.get(region, 0) + cell.effective
                if delta == 0:
                    latest[region] = latest.get(region, 0) + cell.effective
        return counts, recent, latest

    def reservation(self, rule: Rule, subject: bytes, now_us: int) -> Reservation:
        """Units set aside for peers, and whether policy ``closed`` denies."""
        if not (rule.predict or rule.partition != "local"):
            return Reservation(0.0, False)
        counts, recent, latest = self._peer_counts(rule, subject, now_us)
        found = reserve(
            limit=rule.limit, resolution_us=rule.resolution_us, now_us=now_us, counts=counts,
            recent=recent, latest=latest, known_until=self.peer_known, regions=self.regions, predict=rule.predict,
            partition=rule.partition, partition_after_us=rule.partition_after_us,
        )
        if not found.units and not found.closed:
            return Reservation(0.0, False)
        return found

    def reserve_falls_at(self, rule: Rule, subject: bytes, now_us: int) -> int | None:
        """The earliest time the reserve may shrink with no news from the peers, or None (``hit.lua``'s
        ``reserve_falls_at``): see :func:`reserve_falls_at`."""
        if not rule.predict:
            return None
        recent = self._peer_counts(rule, subject, now_us)[1]
        return reserve_falls_at(
            self.peer_known, recent, self.region, now_us, rule.resolution_us, rule.partition_after_us
        )

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
        admitted = all(
            not h.closed
            and evaluate(s, f, now_us, cost, r.limit, r.resolution_us, r.mode == "approximate", False, h.units, fs).allowed
            for r, (s, f), h, fs in zip(rules, windows, held, firsts, strict=True)
        )
        consumed = admitted and consume
        if consumed and cost > 0:
            for rule in rules:
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
            falls = self.reserve_falls_at(r, subject, now_us) if result.stable_us > 0 else None
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

    def merge(self, rule: str, subject: bytes, other: KeyState) -> None:
        """Join a replicated key state into this region's copy."""
        key = (rule, subject)
        self.keys[key] = join(self.keys.get(key, {}), other)

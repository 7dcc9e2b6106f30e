"""Usage: who consumed what in a key's current window (pure decoding)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from geolimit.core.escrow import EscrowState, rights
from geolimit.core.gcounter import parse_slot_id
from geolimit.core.rule import Rule
from geolimit.core.window import bucket_of, count_of, parse_stored_int, read_key

__all__ = ["Usage", "slot_names", "summarize", "summarize_escrow"]


@dataclass(frozen=True)
class Usage:
    """The global count of one rule and subject, broken down by region and slot."""

    rule: str
    subject: bytes
    limit: int
    window: float
    total: int
    remaining: int
    by_region: dict[str, int] = field(default_factory=dict)
    by_slot: dict[str, int] = field(default_factory=dict)
    #: Fields of the key ignored because their name or value was not a valid
    #: number (see :func:`geolimit.core.window.read_key`); not part of ``as_dict``.
    bad: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "subject": self.subject.decode("utf-8", "backslashreplace"),
            "limit": self.limit,
            "window": self.window,
            "total": self.total,
            "remaining": self.remaining,
            "regions": dict(self.by_region),
            "slots": dict(self.by_slot),
        }


def slot_names(registry: Mapping[bytes, bytes]) -> dict[int, str]:
    """Slot index -> slot id (``region/incarnation``) from a shard's registry hash.

    Entries whose index is not a valid non-negative number are skipped (their
    slot then reads as unknown), never raised on.
    """
    names: dict[int, str] = {}
    for name, index in registry.items():
        if name in (b"@", b"#") or b"/" not in name:
            continue
        slot = parse_stored_int(index)
        if slot is not None:
            names[slot] = name.decode("utf-8", "backslashreplace")
    return names


def summarize(
    rule: Rule,
    subject: bytes,
    registry: Mapping[bytes, bytes],
    fields: Mapping[bytes, bytes],
    now_us: int,
) -> Usage:
    """Strict-mode usage of ``rule`` for ``subject`` at ``now_us``.

    ``now_us`` is this Redis's clock; the registry's clock correction (field
    ``k``, set by the agent: ``replication/clock_sync.py``) moves it onto the
    region clock that decisions use.
    """
    correction = parse_stored_int(registry.get(b"k", b"0"), signed=True)
    current = bucket_of(now_us + (correction or 0), rule.resolution_us)
    view = read_key(fields, current, rule.buckets, rule.ring)
    names = slot_names(registry)
    by_slot: dict[str, int] = {}
    for (slot, bucket), (value, floor) in view.cells.items():
        if current - rule.buckets <= bucket <= current:
            name = names.get(slot, f"?/{slot}")
            by_slot[name] = by_slot.get(name, 0) + max(0, count_of(value) - count_of(floor))
    by_region: dict[str, int] = {}
    for name, count in by_slot.items():
        region = parse_slot_id(name)[0] if not name.startswith("?/") else "?"
        by_region[region] = by_region.get(region, 0) + count
    total = sum(view.sums)
    return Usage(
        rule=rule.name,
        subject=subject,
        limit=rule.limit,
        window=rule.window_us / 1e6,
        total=total,
        remaining=max(0, rule.limit - total),
        by_region=by_region,
        by_slot=by_slot,
        bad=view.bad,
    )


def summarize_escrow(
    rule: Rule,
    subject: bytes,
    own_used: int,
    state: EscrowState,
    now_us: int,
    region: str,
    regions: Sequence[str] | None,
) -> Usage:
    """Usage of an escrow rule as this region knows it: its own count in the window
    (``own_used``, exact), each peer's count as its last advert said (adverts of
    the current window only), and ``remaining``: what this region may still admit,
    its rights less its own count (0 while the agent has not published the regions:
    escrow rules are denied then). ``now_us`` is this Redis's own clock, as escrow
    decisions use it."""
    by_region = {region: own_used}
    current = now_us // rule.resolution_us
    for peer, advert in state.adverts.items():
        if peer != region and advert.bucket > current - rule.buckets and advert.used > 0:
            by_region[peer] = advert.used
    held = rights(state, region, regions, rule.limit) if regions and region in regions else 0
    return Usage(
        rule=rule.name,
        subject=subject,
        limit=rule.limit,
        window=rule.window_us / 1e6,
        total=sum(by_region.values()),
        remaining=max(0, held - own_used),
        by_region=by_region,
    )

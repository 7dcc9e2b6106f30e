"""The Redis fields of escrow mode, read into :mod:`geolimit.core.escrow` values, and
the checks of a peer's fields before anything is written. No I/O.

An escrow rule's key (``gl:{shard}:rule:subject``) holds, besides nothing else:

* ``t:<giver>:<receiver>:<limit>`` -- units ``giver`` gave ``receiver`` while its limit
  was ``limit`` (replicated, merged by max);
* ``a:<region>`` -- ``region``'s advert ``version:used:demand:bucket`` (replicated,
  the newer wins);
* ``s<pos>`` -- an own step, ``step:count:last_us`` (this region only);
* ``q`` -- units asked for, ``bucket:requested:requested in the bucket before``;
* ``e`` -- the expiry mark of ``common.lua``.

``hit.lua``, ``escrow_give.lua`` and ``escrow_merge.lua`` read and write the same
forms (``common.lua`` has the readers).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from geolimit.core.escrow import Advert, EscrowState, Ledger, OwnBucket, net_received, share
from geolimit.core.rule import Rule
from geolimit.core.window import MAX_COUNT
from geolimit.errors import ProtocolError

__all__ = [
    "MAX_FIELDS_PER_KEY",
    "MAX_VALUE",
    "OwnFigures",
    "ledger_of",
    "own_figures",
    "replicated",
    "state_of",
    "vet_fields",
]

#: 2**53 - 1: the largest integer Redis's Lua holds exactly.
MAX_VALUE = 2**53 - 1
#: Replicated fields one key may carry in a message (regions² transfers per limit in force, plus adverts).
MAX_FIELDS_PER_KEY = 1024

_TRANSFER = re.compile(rb"t:([A-Za-z0-9_.\-]{1,64}):([A-Za-z0-9_.\-]{1,64}):([1-9][0-9]{0,15})")
_ADVERT = re.compile(rb"a:([A-Za-z0-9_.\-]{1,64})")
_NUMBER = re.compile(rb"0|[1-9][0-9]{0,15}")
_ADVERT_VALUE = re.compile(rb"(0|[1-9][0-9]{0,15}):(0|[1-9][0-9]{0,15}):(0|[1-9][0-9]{0,15}):(0|[1-9][0-9]{0,15})")
_STEP = re.compile(rb"s([0-9]{1,9})")
_STEP_VALUE = re.compile(rb"([0-9]{1,17}):([0-9]{1,17}):([0-9]{1,17})")
_ASKED = re.compile(rb"([0-9]{1,17}):([0-9]{1,17}):([0-9]{1,17})")


def replicated(fields: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """The fields of a key that go to peers: transfers and adverts."""
    return {f: v for f, v in fields.items() if f[:2] in (b"t:", b"a:")}


def state_of(fields: Mapping[bytes, bytes]) -> EscrowState:
    """The replicated escrow state in a key's fields (malformed fields are skipped, as the scripts do)."""
    transfers: dict[tuple[str, str, int], int] = {}
    adverts: dict[str, Advert] = {}
    for name, value in fields.items():
        t = _TRANSFER.fullmatch(name)
        if t is not None and _NUMBER.fullmatch(value) and t.group(1) != t.group(2):
            transfers[(t.group(1).decode(), t.group(2).decode(), int(t.group(3)))] = int(value)
            continue
        a = _ADVERT.fullmatch(name)
        v = _ADVERT_VALUE.fullmatch(value) if a is not None else None
        if a is not None and v is not None:
            version, used, demand, bucket = (int(x) for x in v.groups())
            adverts[a.group(1).decode()] = Advert(version, used, demand, bucket)
    return EscrowState(transfers, adverts)


@dataclass(frozen=True, slots=True)
class OwnFigures:
    """This region's own use and demand of one key, as its advert states them."""

    used: int
    demand: int
    bucket: int


def ledger_of(fields: Mapping[bytes, bytes], rule: Rule) -> Ledger:
    """The own steps of a key as a :class:`~geolimit.core.escrow.Ledger` (no demand)."""
    buckets: dict[int, OwnBucket] = {}
    for name, value in fields.items():
        if _STEP.fullmatch(name):
            m = _STEP_VALUE.fullmatch(value)
            if m is not None:
                step, count, last = (int(x) for x in m.groups())
                buckets[step] = OwnBucket(count, last, 0)
    return Ledger(rule.window_us, rule.resolution_us, rule.escrow_steps, buckets)


def own_figures(fields: Mapping[bytes, bytes], rule: Rule, now_us: int) -> OwnFigures:
    """Own use in the window ending at ``now_us`` and demand per window (``common.lua``'s
    ``escrow_used`` and ``escrow_demand``)."""
    used = ledger_of(fields, rule).used(now_us)
    res = rule.resolution_us
    b = now_us // res
    asked = 0
    m = _ASKED.fullmatch(fields.get(b"q", b""))
    if m is not None:
        qb, q, qp = (int(x) for x in m.groups())
        asked = q + qp if qb == b else q if qb == b - 1 else 0
    span = max(1, now_us - (b - 1) * res)
    return OwnFigures(used, -(-asked * rule.window_us // span), b)


def _refuse(why: str) -> ProtocolError:
    return ProtocolError(f"escrow: {why}")


def vet_fields(fields: Sequence[object], regions: Collection[str]) -> list[tuple[bytes, bytes]]:
    """A peer's ``[name, value, name, value, ...]`` of one key as pairs, or
    :class:`~geolimit.errors.ProtocolError` naming the first fault.

    Only transfers and adverts, only between configured ``regions``, with numbers
    Redis's Lua holds exactly; a transfer's limit is one a rule may have; and no
    region gives away more than it held (its share plus what it was given).
    """
    if len(fields) % 2 or len(fields) > 2 * MAX_FIELDS_PER_KEY:
        raise _refuse(f"a key carries name, value pairs, at most {MAX_FIELDS_PER_KEY} of them")
    known = {r.encode() for r in regions}
    out: list[tuple[bytes, bytes]] = []
    seen: set[bytes] = set()
    transfers: dict[tuple[str, str, int], int] = {}
    for i in range(0, len(fields), 2):
        name, value = fields[i], fields[i + 1]
        if type(name) is not bytes or type(value) is not bytes:
            raise _refuse("field names and values must be bytes")
        if name in seen:
            raise _refuse(f"field {name[:80]!r} given twice")
        seen.add(name)
        t = _TRANSFER.fullmatch(name)
        if t is not None:
            if t.group(1) not in known or t.group(2) not in known or t.group(1) == t.group(2):
                raise _refuse(f"transfer {name[:140]!r} between regions that are not configured (or to itself)")
            if int(t.group(3)) > MAX_COUNT:
                raise _refuse(f"transfer {name[:140]!r} under a limit over 2**46")
            if not _NUMBER.fullmatch(value) or int(value) > MAX_VALUE:
                raise _refuse(f"transfer {name[:140]!r} has a bad amount {value[:40]!r}")
            transfers[(t.group(1).decode(), t.group(2).decode(), int(t.group(3)))] = int(value)
        else:
            a = _ADVERT.fullmatch(name)
            if a is None:
                raise _refuse(f"field {name[:80]!r} is neither a transfer nor an advert")
            if a.group(1) not in known:
                raise _refuse(f"advert of a region that is not configured: {a.group(1)[:64]!r}")
            m = _ADVERT_VALUE.fullmatch(value)
            if m is None or any(int(x) > MAX_VALUE for x in m.groups()):
                raise _refuse(f"advert {name[:80]!r} has a bad value {value[:80]!r}")
        out.append((name, value))
    _check_funding(EscrowState(transfers), sorted(regions))
    return out



def _check_funding(state: EscrowState, regions: Sequence[str]) -> None:
    """Refuse a key in which some region gave away more than it ever held: its
    share plus what it was given.

    A peer sends a key's whole replicated state (every transfer it knows), and a
    region gives only from its rights, so in any honest state each giver ``g`` has
    ``out(g) - in(g) <= share(L) / L`` (as fractions of the limit ``L`` a transfer was
    made under; the largest such share over ``g``'s limits). A forged gift, say
    ``t:c:b:10 = 1000`` that ``c`` never made, fails this before anything is written.
    """
    caps: dict[str, Fraction] = {}
    for giver, _, limit in state.transfers:
        caps[giver] = max(caps.get(giver, Fraction(0)), Fraction(share(limit, regions, giver), limit))
    for giver, cap in caps.items():
        given = -net_received(state, giver)
        if given > cap:
            raise _refuse(f"region {giver!r} gave away more of this key's limit than it held "
                          f"({float(given):.3g} of it, its share {float(cap):.3g})")

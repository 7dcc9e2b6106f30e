"""Over-admission control across regions (pure; mirrors ``hit.lua``).

Remote counts are always a little stale. Before deciding, a region *reserves*
budget for what its peers have probably admitted since it last heard from them:

* **prediction** (``Rule.predict``): a peer that is still in contact is assumed
  to keep admitting at its recent rate for as long as its counts are stale:
  ``reserve += rate * staleness``. The rate comes from the peer's last update
  that raised the key (a :class:`Rise`, recorded by ``merge.lua``): what its count
  rose by over the time since its previous update. A peer whose counts were
  current after that rise arrived (``known_until > Rise.at_us``) did not admit
  since: it has stopped on the key and is reserved nothing;
* **the split of freed room** (approximate mode, with prediction): a peer that
  stopped because it was denied resumes as soon as room frees up, in every
  region at once. A peer that rose within the last ``partition_after`` is
  reserved at least its share of the window's count of the room this region sees
  (plus this region's own admissions since the peers' counts were current, field
  'u': :class:`Quanta`), at most what its last rises admit while it is stale;
  *contested* room (at most what the window frees and takes in ``partition_after``)
  is split without that cap, among every peer in contact if the oldest bucket just
  freed all of it, leaving this region at least one unit (see :func:`reserve`);
* **partition policy** (``Rule.partition``), for a peer whose counts are older
  than ``Rule.partition_after``:

  - ``local``: keep deciding on the last known counts (no reservation);
  - ``share``: assume the peer uses its fair share of the limit, ``limit / R``:
    ``reserve += max(0, limit / R - known count)``. Both sides of a partition
    apply it, so together they stay within the limit;
  - ``closed``: deny.

Freshness comes from the agent, which writes, per shard, when each peer's counts
were last current (in the clock decisions use) and how many regions there are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from geolimit.core.window import MARGIN, SUBSTEPS

__all__ = [
    "PARTITION_POLICIES", "QUANTA", "Quanta", "Reservation", "Rise", "Window", "freeing", "intake", "own_since",
    "predicted_rate", "predicted_retry", "quanta_add", "quantum_us", "reserve",
]

PARTITION_POLICIES = ("local", "share", "closed")
#: How many quanta of its own admissions a key keeps (``hit.lua``'s field 'u').
QUANTA = 8


def quantum_us(partition_after_us: int) -> int:
    """The length of a quantum of a key's own-admission record: partition_after / 16."""
    return max(1, partition_after_us // 16)


@dataclass(frozen=True, slots=True)
class Quanta:
    """This region's own admissions of a key per quantum (field 'u' = 'q c1 c2 ... cK')."""

    q: int  # the newest quantum's number (time // quantum)
    counts: tuple[int, ...]  # its count, then those of the quanta before it (at most QUANTA)


def quanta_add(quanta: Quanta | None, now_us: int, q_us: int, cost: int) -> Quanta:
    """The record after this region admits ``cost`` more at ``now_us``."""
    qn = now_us // q_us
    if quanta is not None and quanta.q == qn:
        return Quanta(qn, (quanta.counts[0] + cost, *quanta.counts[1:]))
    if quanta is not None and quanta.q < qn:
        shift = qn - quanta.q
        rest = [quanta.counts[j - shift] if 0 <= j - shift < len(quanta.counts) else 0 for j in range(1, QUANTA)]
        return Quanta(qn, (cost, *rest))
    return Quanta(qn, (cost,))


def own_since(quanta: Quanta | None, now_us: int, q_us: int, since_us: int) -> float:
    """This region's own admissions after ``since_us`` (those of a quantum that ``since_us``
    cuts assumed uniform over its elapsed part)."""
    if quanta is None:
        return 0
    total: float = 0
    for j, count in enumerate(quanta.counts):
        lo = (quanta.q - j) * q_us
        hi = min(lo + q_us, now_us)
        if lo >= since_us:
            total += count
        elif hi > since_us and hi > lo:
            total += count * (hi - since_us) / (hi - lo)
    return total


def freeing(count: int, first: int, resolution_us: int) -> float:
    """Approximate mode: how fast the oldest bucket's ``count`` units free room, in units
    per µs (the slope of :func:`~geolimit.core.window.oldest_part` while it is below
    ``count``; ``first`` is the bucket's first-admission offset, as in
    :func:`~geolimit.core.window.share`)."""
    if count <= 0:
        return 0.0
    if first >= SUBSTEPS:
        first = -1
    span = resolution_us - (first + 1) * resolution_us / SUBSTEPS
    if span <= 0:
        return 0.0
    return (count + MARGIN * math.sqrt(count)) / span


@dataclass(frozen=True, slots=True)
class Rise:
    """The last update of a peer (one slot) that raised a key's count."""

    at_us: int  # when it was merged (the clock decisions use)
    units: int  # what the slot's count rose by
    gap_us: int  # the time between that update and the peer's previous one (> 0)


def predicted_rate(rises: Sequence[Rise], until_us: int) -> float:
    """A peer's predicted rate (units per µs) from its slots' last rises of a key.

    A rise that arrived before the peer's counts were last current (``until_us``)
    is over: the peer's updates since showed no new admission.
    """
    rate = 0.0
    for rise in rises:
        if rise.at_us >= until_us:
            rate += rise.units / rise.gap_us
    return rate


@dataclass(frozen=True, slots=True)
class Reservation:
    units: float  # extra count the decision must assume
    closed: bool  # a partitioned peer and policy "closed": deny
    predicted: float = 0.0  # the part of ``units`` predicted from peers' rates (policy "local" only)
    predicted_until_us: int = 0  # when, with no news from the peers, that prediction is gone
    #: When, with no news from the peers, ``units`` may first shrink (None: never before
    #: news): the first end of a peer's prediction above 0 (before it, ``rate * stale`` only grows).
    falls_at_us: int | None = None


def predicted_retry(retry_us: int, plain_retry_us: int, predicted_until_us: int, now_us: int) -> int:
    """``retry_after`` of a request that a predicted reserve may be denying.

    With no new traffic the prediction is gone at ``predicted_until_us`` (the
    peers' counts are then ``partition_after`` old), so the request is admitted
    by then or when its window alone admits it (``plain_retry_us``: the retry
    without the predicted units), whichever is later; never later than
    ``retry_us`` itself.
    """
    if retry_us <= 0:
        return retry_us
    return min(retry_us, max(plain_retry_us, predicted_until_us - now_us))


class Window(NamedTuple):
    """Approximate mode: what :func:`reserve` needs of the window (``hit.lua``'s ``win``)."""

    weighted: float  # the weighted count, without any reserve
    total: int  # the plain total of the window's buckets
    freeing: float  # how fast the oldest bucket frees room (units per µs, :func:`freeing`)
    intake: float  # how fast the window took units lately (:func:`intake`)


def intake(sums: Sequence[int], now_us: int, resolution_us: int) -> float:
    """Units per µs the window took lately: the current and the previous bucket's totals
    over the time since the previous bucket began (``sums`` as
    :func:`~geolimit.core.window.window_sums` returns them, at least two buckets)."""
    return (sums[0] + sums[1]) / (now_us - (now_us // resolution_us - 1) * resolution_us)


def reserve(
    *,
    limit: int,
    now_us: int,
    counts: Mapping[str, int],
    rises: Mapping[str, Sequence[Rise]],
    known_until: Mapping[str, int],
    regions: int,
    predict: bool,
    partition: str,
    partition_after_us: int,
    window: Window | None = None,
    own: Quanta | None = None,
) -> Reservation:
    """What to reserve for peers.

    ``counts`` is each peer region's count in the window, ``rises`` the last rise
    of each of its slots (see :func:`predicted_rate`); ``known_until`` maps every
    peer to the time its counts were last current; ``regions`` counts all regions.

    Approximate mode (``window``) also splits the room: every region sees the same
    room free up at the same moment, and a peer denied until then has no rise to
    predict from. The room this region would see without its own admissions since
    the stalest peer's counts were current (``own``: its record of them) is split by
    the regions' shares of the window's count.

    * *Contested room*: the room is at most what the window frees and takes in
      ``partition_after`` (``window.freeing``, ``window.intake``): whoever wants it
      races for it. A peer is reserved its share, uncapped, if it rose within the
      last ``partition_after``, or whatever its last rise if all of the room was
      freed by the oldest bucket within ``partition_after`` (*fresh*: the window was
      full, so a silent peer may only have been denied). Together the peers are
      reserved at most the room less one unit, so that the last unit goes to someone
      (each region may take one unit when its share is less: at most ``R - 1`` over).
    * Otherwise (standing room), a peer is reserved its share at most what its rises
      of the last ``partition_after`` would admit while its counts are stale (a peer
      with no recent rise has no demand to reserve for), or its predicted rate times
      its staleness, whichever is more.
    """
    units = 0.0
    closed = False
    predicted = 0.0
    ends = 0
    falls: int | None = None
    base = 0.0
    pool = 0.0
    if window is not None:
        # The room and the count are split between the regions in contact: a partitioned
        # peer's count is left out, and so is what policy share reserves for it.
        stalest: int | None = None
        gone = 0
        away = 0.0
        for region, until in known_until.items():
            if now_us - until <= partition_after_us:
                if stalest is None or until < stalest:
                    stalest = until
            else:
                gone += counts.get(region, 0)
                if partition == "share" and regions > 0 and limit / regions > counts.get(region, 0):
                    away += limit / regions - counts.get(region, 0)
        if stalest is not None:
            mine = own_since(own, now_us, quantum_us(partition_after_us), stalest)
            base = limit - window.weighted - away + mine
            # shares of the count as it was then: taking its share does not grow this region's
            pool = window.total - gone - mine
            if pool <= 0:
                pool = window.total
    split = base > 0 and window is not None and window.total > 0
    fresh = split and window is not None and base <= window.freeing * partition_after_us
    contested = fresh or (split and window is not None and base <= (window.freeing + window.intake) * partition_after_us)
    shared = 0.0
    for region, until in known_until.items():
        stale = now_us - until if now_us > until else 0
        if stale > partition_after_us:
            if partition == "closed":
                closed = True
            elif partition == "share":
                fair = limit / regions if regions > 0 else 0.0
                have = counts.get(region, 0)
                if fair > have:
                    units += fair - have
        elif predict and stale > 0:
            rate = predicted_rate(rises.get(region, ()), until)
            held = rate * stale
            recent = [r for r in rises.get(region, ()) if r.at_us >= now_us - partition_after_us] if split else []
            if contested and window is not None and (fresh or recent):
                held = counts.get(region, 0) / pool * base
                if held > 0:  # it moves with the room, continuously
                    falls = now_us
                shared += held
            elif split and window is not None:
                last = 0.0
                for rise in recent:
                    last += rise.units / rise.gap_us
                part = counts.get(region, 0) / pool * base
                if part > last * stale:
                    part = last * stale
                if part > held:
                    held = part
                if part > 0:  # it shrinks when a rise leaves the last partition_after
                    for rise in recent:
                        gone = rise.at_us + partition_after_us + 1
                        if falls is None or gone < falls:
                            falls = gone
            units += held
            predicted += held
            # Once its counts are older than partition_after, a peer is no longer predicted for.
            ends = max(ends, until + partition_after_us + 1)
            # News may come before that: an update current at `until2` ends the rate of rises
            # merged before `until2` only (a rise is merged after the counts it came with were
            # current: news travels), and approximate mode counts a rise for partition_after
            # after its merge. So the prediction may last until the newest such rise is
            # partition_after old, whatever news comes.
            newest = [r.at_us for r in rises.get(region, ()) if r.at_us >= until] + [r.at_us for r in recent]
            if newest:
                ends = max(ends, max(newest) + partition_after_us + 1)
            if rate > 0 and (falls is None or until + partition_after_us + 1 < falls):
                falls = until + partition_after_us + 1
    if shared > 0 and shared > base - 1:  # the last unit of the room goes to someone
        cut = shared - (base - 1 if base > 1 else 0)
        units, predicted = units - cut, predicted - cut
    if partition != "local":
        predicted, ends = 0.0, 0  # the share/closed policy takes over afterwards: no cap
    return Reservation(units, closed, predicted, ends, falls)

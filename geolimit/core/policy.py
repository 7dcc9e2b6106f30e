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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PARTITION_POLICIES", "Reservation", "Rise", "predicted_rate", "predicted_retry", "reserve"]

PARTITION_POLICIES = ("local", "share", "closed")


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
) -> Reservation:
    """What to reserve for peers.

    ``counts`` is each peer region's count in the window, ``rises`` the last rise
    of each of its slots (see :func:`predicted_rate`); ``known_until`` maps every peer to the time its counts were last current;
    ``regions`` counts all regions.
    """
    units = 0.0
    closed = False
    predicted = 0.0
    ends = 0
    falls: int | None = None
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
            units += rate * stale
            predicted += rate * stale
            # Once its counts are older than partition_after, a peer is no longer predicted for.
            ends = max(ends, until + partition_after_us + 1)
            if rate > 0 and (falls is None or until + partition_after_us + 1 < falls):
                falls = until + partition_after_us + 1
    if partition != "local":
        predicted, ends = 0.0, 0  # the share/closed policy takes over afterwards: no cap
    return Reservation(units, closed, predicted, ends, falls)

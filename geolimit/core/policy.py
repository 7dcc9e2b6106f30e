"""Over-admission control across regions (pure; mirrors ``hit.lua``).

Remote counts are always a little stale. Before deciding, a region *reserves*
budget for what its peers have probably admitted since it last heard from them:

* **prediction** (``Rule.predict``): a peer that is still in contact is assumed
  to keep admitting at its recent rate for as long as its counts are stale:
  ``reserve += rate * staleness``. The rate is its count in the last two buckets
  over the time they span up to its freshness, or, if higher, its rate so far in
  the current bucket (when capacity frees up, peers admit at their demand rate,
  which the throttled past underestimates);
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

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PARTITION_POLICIES", "Reservation", "predicted_retry", "reserve"]

PARTITION_POLICIES = ("local", "share", "closed")


@dataclass(frozen=True, slots=True)
class Reservation:
    units: float  # extra count the decision must assume
    closed: bool  # a partitioned peer and policy "closed": deny
    predicted: float = 0.0  # the part of ``units`` predicted from peers' rates (policy "local" only)
    predicted_until_us: int = 0  # when, with no news from the peers, that prediction is gone


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
    resolution_us: int,
    now_us: int,
    counts: Mapping[str, int],
    recent: Mapping[str, int],
    latest: Mapping[str, int],
    known_until: Mapping[str, int],
    regions: int,
    predict: bool,
    partition: str,
    partition_after_us: int,
) -> Reservation:
    """What to reserve for peers.

    ``counts``/``recent``/``latest`` are each peer region's count in the window,
    in the last two buckets (``c-1`` and ``c``) and in the current bucket;
    ``known_until`` maps every peer to the time its counts were last current;
    ``regions`` counts all regions.
    """
    units = 0.0
    closed = False
    predicted = 0.0
    ends = 0
    current = now_us // resolution_us
    start = (current - 1) * resolution_us
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
            span: float = until - start
            if span < resolution_us / 2:
                span = resolution_us / 2
            rate = recent.get(region, 0) / span
            into = until - (start + resolution_us)
            if into > resolution_us / 10:
                now_rate = latest.get(region, 0) / into
                if now_rate > rate:
                    rate = now_rate
            units += rate * stale
            predicted += rate * stale
            # Once its counts are older than partition_after, a peer is no longer predicted for.
            ends = max(ends, until + partition_after_us + 1)
    if partition != "local":
        predicted, ends = 0.0, 0  # the share/closed policy takes over afterwards: no cap
    return Reservation(units, closed, predicted, ends)

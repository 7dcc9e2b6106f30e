"""The exact global oracle: a sliding log of every admitted request.

Given every request (its true time, cost, region and geolimit's decision), it
measures what a perfect global limiter would have done with the same history:

* **over-admission**: the most cost admitted in any true window ``[t - W, t]``,
  minus the limit (max, and the mean over windows sampled every 100 ms);
* **under-use**: over the sampled windows where demand reached the limit, how far
  admissions stayed below it (mean, as a fraction of the limit);
* **wrong decisions**: a request was *wrongly allowed* if, counting what had
  really been admitted in its window, it did not fit; *wrongly denied* if it did.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["Accuracy", "Request", "measure"]


@dataclass(frozen=True, slots=True)
class Request:
    time_us: int  # true (unskewed) time
    region: str
    cost: int
    allowed: bool


@dataclass(frozen=True)
class Accuracy:
    requests: int
    admitted: int
    max_over: int  # units over the limit in the worst true window
    max_over_pct: float
    mean_over_pct: float
    under_use_pct: float
    wrongly_allowed_pct: float
    wrongly_denied_pct: float
    admitted_by_region: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def measure(
    requests: Sequence[Request], limit: int, window_us: int, start_us: int, end_us: int, step_us: int = 100_000
) -> Accuracy:
    ordered = sorted(requests, key=lambda r: r.time_us)
    times = [r.time_us for r in ordered if r.allowed]
    prefix = [0]
    for r in ordered:
        if r.allowed:
            prefix.append(prefix[-1] + r.cost)
    all_times = [r.time_us for r in ordered]
    demand = [0]
    for r in ordered:
        demand.append(demand[-1] + r.cost)

    def admitted_in(lo: int, hi: int) -> int:
        """Admitted cost with lo <= time <= hi."""
        return prefix[bisect.bisect_right(times, hi)] - prefix[bisect.bisect_left(times, lo)]

    def demanded_in(lo: int, hi: int) -> int:
        return demand[bisect.bisect_right(all_times, hi)] - demand[bisect.bisect_left(all_times, lo)]

    worst = 0
    for t in times:
        worst = max(worst, admitted_in(t - window_us, t) - limit)
    over: list[float] = []
    under: list[float] = []
    t = start_us + window_us
    while t <= end_us:
        got = admitted_in(t - window_us + 1, t)
        over.append(max(0, got - limit) / limit)
        if demanded_in(t - window_us + 1, t) >= limit:
            under.append(max(0, limit - got) / limit)
        t += step_us
    wrong_allowed = wrong_denied = 0
    for r in ordered:
        before = admitted_in(r.time_us - window_us, r.time_us) - (r.cost if r.allowed else 0)
        fits = before + r.cost <= limit
        if r.allowed and not fits:
            wrong_allowed += 1
        elif not r.allowed and fits:
            wrong_denied += 1
    by_region: dict[str, int] = {}
    for r in ordered:
        if r.allowed:
            by_region[r.region] = by_region.get(r.region, 0) + r.cost
    n = max(1, len(ordered))
    return Accuracy(
        requests=len(ordered),
        admitted=prefix[-1],
        max_over=max(0, worst),
        max_over_pct=100.0 * max(0, worst) / limit,
        mean_over_pct=100.0 * sum(over) / max(1, len(over)),
        under_use_pct=100.0 * sum(under) / max(1, len(under)),
        wrongly_allowed_pct=100.0 * wrong_allowed / n,
        wrongly_denied_pct=100.0 * wrong_denied / n,
        admitted_by_region=by_region,
    )

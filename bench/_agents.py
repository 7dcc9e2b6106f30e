"""Helpers of bench/soak.py, bench/agents.py and bench/flood.py: agent processes, their
RSS, CPU and status, and the soak's load, one process per region (split out of _common.py).
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
import subprocess
import sys
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import redis.asyncio
from _common import quantile

from geolimit import AsyncLimiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.usage import Usage, summarize
from geolimit.errors import GeolimitError

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

"""Overhead of `geolimit proxy` against calling the upstream directly, measured in the same run.

    python bench/proxy.py [--rounds 9] [--seq 600] [--seconds 1.5] [--concurrency 32] [--workers N]
                          [--no-limits] [--no-fast-path] [--json PATH]

Four processes on loopback: an embedded redis-server, an aiohttp upstream app, the
proxy (``python -m geolimit.cli proxy``, library mode: one rule with a huge limit
on every path, so each proxied request makes a real Redis decision; ``--workers N``
runs N proxy processes on one port under a supervisor; ``--no-limits``: a route
without limits, so no decision is made, which measures the forwarding alone;
``--no-fast-path``: ``[proxy] fast_path = false``, aiohttp's server and client in the
data path) and one load generator
process (aiohttp client). In every round the generator measures, in
alternating order, the direct path and the proxied path:

* latency: ``--seq`` sequential GETs each; the round's figure is the difference of
  the two medians;
* throughput: ``--concurrency`` requests in flight for ``--seconds`` each; the
  round's figure is proxied / direct requests per second.

The verdicts use the medians over rounds. Targets: at most 1.5 ms added (median)
and at least 60 % of the direct throughput. Also printed: each process's CPU per
request, how busy the machine's CPUs were (a proxied run that leaves them idle is
bound by hand-offs between the processes, not by CPU), and the script calls Redis
ran during the rounds (decisions a call, Redis time a call and a decision, from
``INFO commandstats``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

TARGET_ADDED_MS = 1.5
TARGET_RATIO = 0.60
BODY = json.dumps({"ok": True, "items": list(range(16))}).encode()


# -- roles run in their own processes ----------------------------------------------------


def serve_upstream() -> None:
    from aiohttp import web

    from geolimit.http.listener import listen

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        _, port = await listen(runner, "127.0.0.1", 0)
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        await runner.cleanup()

    asyncio.run(main())


async def _sequential(session: aiohttp.ClientSession, url: str, n: int) -> dict[str, Any]:
    lat = []
    errors = 0
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        async with session.get(url) as resp:
            await resp.read()
            errors += resp.status != 200
        lat.append(clock() - t0)
    lat.sort()
    return {"median": lat[len(lat) // 2], "p90": lat[int(len(lat) * 0.9)], "errors": errors}


async def _concurrent(session: aiohttp.ClientSession, url: str, workers: int, seconds: float) -> dict[str, Any]:
    done = errors = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            async with session.get(url) as resp:
                await resp.read()
                errors += resp.status != 200
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return {"rps": done / (time.perf_counter() - started), "errors": errors, "requests": done}


def load_generator() -> None:
    """Reads one JSON command per stdin line, answers one JSON line per command."""

    async def main() -> None:
        sessions: dict[str, aiohttp.ClientSession] = {}
        loop = asyncio.get_running_loop()
        try:
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                cmd = json.loads(line)
                url = cmd["url"]
                if url not in sessions:
                    sessions[url] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                session = sessions[url]
                if cmd["mode"] == "seq":
                    result = await _sequential(session, url, cmd["n"])
                else:
                    result = await _concurrent(session, url, cmd["workers"], cmd["seconds"])
                print(json.dumps(result), flush=True)
        finally:
            for session in sessions.values():
                await session.close()

    asyncio.run(main())


# -- orchestration ----------------------------------------------------------------------------


class Child:
    def __init__(self, *args: str, stderr: Any = subprocess.DEVNULL) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the load generator died")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proxy_toml(upstream: str, redis_url: str, ports: tuple[int, int] = (0, 0), limits: bool = True,
               fast_path: bool = True, extra: str = "") -> str:
    """The benchmarks' proxy.toml: one rule with a huge limit on every path (``limits``), library mode;
    ``extra``: more lines of ``[proxy]``."""
    return f"""
[proxy]
listen = "127.0.0.1:{ports[0]}"
admin_listen = "127.0.0.1:{ports[1]}"
upstreams = ["{upstream}"]
region = "bench"
redis_url = "{redis_url}"
fast_path = {str(fast_path).lower()}
{extra}
[[rule]]
name = "bench"
limit = "1000000000/10s"

[[route]]
path = "/*"
limits = {'[ { rule = "bench", key = "ip" } ]' if limits else "[]"}

[log]
level = "INFO"
"""


def start_proxy(upstream: str, redis_url: str, workdir: Path, workers: int, limits: bool = True,
                fast_path: bool = True) -> tuple[subprocess.Popen[str], str, str, list[int]]:
    """The proxy process, its URL, its admin URL and the pids doing the work (its workers, if any)."""
    config = workdir / "proxy.toml"
    ports = (free_port(), free_port()) if workers > 1 else (0, 0)  # workers share fixed ports
    config.write_text(proxy_toml(upstream, redis_url, ports, limits, fast_path))
    proc = subprocess.Popen([sys.executable, "-m", "geolimit.cli", "proxy", "--config", str(config),
                             "--workers", str(workers)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    pids, listening = [proc.pid], 0
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        started = re.search(r"started \d+ workers \(pids ([\d, ]+);", line)
        if started:
            pids = [int(pid) for pid in started.group(1).split(", ")]
        found = re.search(r"listening on (http://\S+) \(admin: (http://[0-9.:]+)", line)
        if found:
            listening += 1
            if listening == workers:
                return proc, found.group(1), found.group(2), pids
        if not line and proc.poll() is not None:
            break
    raise SystemExit("the proxy did not start")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_times() -> tuple[float, float]:
    """(busy, all) CPU time of the whole machine so far, in clock ticks (Linux /proc/stat; zeros elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return float(sum(ticks[:8]) - idle), float(sum(ticks[:8]))


def decisions(admin: str) -> float:
    import urllib.request

    with urllib.request.urlopen(admin + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("geolimit_proxy_decisions_total{") and 'result="allowed"' in line)


def script_calls(redis_url: str) -> tuple[int, float]:
    """How many script calls (``EVALSHA`` and ``FCALL``) Redis has run, and the µs it spent in them."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = usec = 0.0
    for name in ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_eval"):
        calls += stats.get(name, {}).get("calls", 0)
        usec += stats.get(name, {}).get("usec", 0)
    return int(calls), usec


def run(args: argparse.Namespace) -> int:
    from geolimit.store.embedded import EmbeddedRedis

    redis_server = EmbeddedRedis().start()
    upstream = Child(__file__, "--role", "upstream")
    loadgen = Child(__file__, "--role", "load")
    proxy_proc = None
    try:
        assert upstream.proc.stdout is not None
        upstream_url = f"http://127.0.0.1:{int(upstream.proc.stdout.readline())}"
        with tempfile.TemporaryDirectory() as tmp:
            proxy_proc, proxy_url, admin, proxy_pids = start_proxy(upstream_url, redis_server.url, Path(tmp),
                                                                   args.workers, not args.no_limits,
                                                                   not args.no_fast_path)
            targets = {"direct": upstream_url + "/api/items", "proxy": proxy_url + "/api/items"}
            for url in targets.values():  # warm up connections, code paths and Redis scripts
                loadgen.ask({"url": url, "mode": "seq", "n": 300})
                loadgen.ask({"url": url, "mode": "conc", "workers": args.concurrency, "seconds": 0.3})
            if args.workers > 1:
                time.sleep(1.5)  # the other workers' shared figures are up to 1 s old
            before = decisions(admin)
            calls_before = script_calls(redis_server.url)
            load_before = os.getloadavg()[0]
            pids = {"load generator": [loadgen.proc.pid], "upstream": [upstream.proc.pid], "proxy": proxy_pids,
                    "redis-server": [redis_server.pid or 0]}
            rounds: list[dict[str, Any]] = []
            proxied_requests = 0
            for i in range(args.rounds):
                order = ["direct", "proxy"] if i % 2 == 0 else ["proxy", "direct"]
                seq = {name: loadgen.ask({"url": targets[name], "mode": "seq", "n": args.seq}) for name in order}
                conc, cpu, busy = {}, {}, {}
                for name in order:
                    start = {proc: sum(map(cpu_seconds, ids)) for proc, ids in pids.items()}
                    machine_before = machine_times()
                    conc[name] = loadgen.ask({"url": targets[name], "mode": "conc", "workers": args.concurrency,
                                              "seconds": args.seconds})
                    machine_after = machine_times()
                    elapsed = machine_after[1] - machine_before[1]
                    busy[name] = (machine_after[0] - machine_before[0]) / elapsed if elapsed else 0.0
                    cpu[name] = {proc: (sum(map(cpu_seconds, ids)) - start[proc]) / max(1, conc[name]["requests"]) * 1e6
                                 for proc, ids in pids.items()}
                errors = sum(r["errors"] for r in (*seq.values(), *conc.values()))
                if errors:
                    raise SystemExit(f"round {i}: {errors} non-200 answers")
                proxied_requests += args.seq + conc["proxy"]["requests"]
                rounds.append({
                    "direct_ms": seq["direct"]["median"] * 1e3, "proxy_ms": seq["proxy"]["median"] * 1e3,
                    "added_ms": (seq["proxy"]["median"] - seq["direct"]["median"]) * 1e3,
                    "direct_p90_ms": seq["direct"]["p90"] * 1e3, "proxy_p90_ms": seq["proxy"]["p90"] * 1e3,
                    "direct_rps": conc["direct"]["rps"], "proxy_rps": conc["proxy"]["rps"],
                    "ratio": conc["proxy"]["rps"] / conc["direct"]["rps"],
                    "cpu_us": cpu, "busy": busy,
                })
                r = rounds[-1]
                print(f"round {i + 1}/{args.rounds}: direct {r['direct_ms']:.3f} ms, proxy {r['proxy_ms']:.3f} ms "
                      f"(+{r['added_ms']:.3f}); {r['direct_rps']:.0f} vs {r['proxy_rps']:.0f} req/s "
                      f"({r['ratio']:.0%})", flush=True)
            if args.workers > 1:
                time.sleep(1.5)  # the other workers' shared figures are up to 1 s old
            decided = decisions(admin) - before
            calls_after = script_calls(redis_server.url)
            load_after = os.getloadavg()[0]
    finally:
        if proxy_proc is not None:
            proxy_proc.terminate()
            proxy_proc.wait(15)
        loadgen.stop()
        upstream.stop()
        redis_server.stop()

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rounds))

    added, ratio = med("added_ms"), med("ratio")
    rows = [
        ("metric", "direct", "proxy", "result", "target", "verdict"),
        ("sequential median latency", f"{med('direct_ms'):.3f} ms", f"{med('proxy_ms'):.3f} ms",
         f"+{added:.3f} ms", f"<= +{TARGET_ADDED_MS} ms", "PASS" if added <= TARGET_ADDED_MS else "MISS"),
        ("sequential p90 latency", f"{med('direct_p90_ms'):.3f} ms", f"{med('proxy_p90_ms'):.3f} ms",
         f"+{med('proxy_p90_ms') - med('direct_p90_ms'):.3f} ms", "", ""),
        (f"throughput, {args.concurrency} in flight", f"{med('direct_rps'):.0f} req/s", f"{med('proxy_rps'):.0f} req/s",
         f"{ratio:.0%} of direct", f">= {TARGET_RATIO:.0%}", "PASS" if ratio >= TARGET_RATIO else "MISS"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(f"\ngeolimit proxy overhead: {args.rounds} interleaved rounds, medians over rounds "
          f"(python {platform.python_version()}, aiohttp {aiohttp.__version__}, proxy on {loop}, "
          f"{os.cpu_count()} CPUs, {args.workers} proxy worker{'s' if args.workers > 1 else ''}"
          f"{', no limits' if args.no_limits else ''}{', fast path off' if args.no_fast_path else ''})")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"Redis decisions made by the proxy during the rounds: {decided:.0f} "
          f"(proxied requests: {proxied_requests})")
    calls, usec = calls_after[0] - calls_before[0], calls_after[1] - calls_before[1]
    if calls:
        print(f"Script calls: {calls} ({decided / calls:.1f} decisions a call), Redis time in them "
              f"{usec / calls:.1f} us a call, {usec / max(1, decided):.1f} us a decision")
    print(f"\nCPU per request during the throughput runs (medians over rounds; load average "
          f"{load_before:.2f} -> {load_after:.2f} on {os.cpu_count()} CPUs, other processes included):")
    cpu_rows: list[list[str]] = [["process", "direct", "proxied"]]
    for proc in pids:
        cpu_rows.append([proc, *(f"{statistics.median(r['cpu_us'][path][proc] for r in rounds):.0f} us"
                                 for path in ("direct", "proxy"))])
    cpu_rows.append(["total", *(f"{statistics.median(sum(r['cpu_us'][path].values()) for r in rounds):.0f} us"
                                for path in ("direct", "proxy"))])
    cpu_rows.append(["machine busy", *(f"{statistics.median(r['busy'][path] for r in rounds):.0%}"
                                       for path in ("direct", "proxy"))])
    for cpu_row in cpu_rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(cpu_row, (16, 10, 10), strict=True)).rstrip())
    print(f"(machine busy: the share of all {os.cpu_count()} CPUs' time not idle during the runs, other processes "
          f"included)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "added_ms": added, "ratio": ratio,
                                               "decisions": decided, "proxied": proxied_requests}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("bench", "upstream", "load"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seq", type=int, default=600, help="sequential requests per path per round")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds of concurrent load per path per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="proxy processes sharing the port (geolimit proxy --workers)")
    parser.add_argument("--no-limits", action="store_true", help="a route without limits (no decisions)")
    parser.add_argument("--no-fast-path", action="store_true", help="fast_path = false (aiohttp in the data path)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.role == "upstream":
        serve_upstream()
        return 0
    if args.role == "load":
        load_generator()
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Decisions per second of the agent's Envoy rate limit service (gRPC) against its HTTP ``/v1/check``.

    python bench/rls.py [--rounds 3] [--seconds 3] [--concurrency 64] [--json PATH]

Processes on loopback: an embedded redis-server and one ``geolimit agent`` (a
``[[rule]]`` and a descriptor file with the same huge limit, so every call makes
a real decision in Redis and all are allowed). This process is the client and
alternates, round by round, the two ways of asking for one decision on one of
1000 subjects:

* gRPC: ``ShouldRateLimit`` with one descriptor ``[("user", "u<n>")]``, on one
  HTTP/2 connection with ``--concurrency`` streams in flight (as an Envoy worker
  holds one connection to its rate limit service);
* HTTP: ``POST /v1/check {"rule": "api", "subject": "u<n>"}``, with
  ``--concurrency`` keep-alive connections each with one request in flight.

Each round runs both for ``--seconds`` (after a short warm-up), in alternating
order; the verdict compares the medians over rounds. Target: gRPC at least 2x HTTP.
The client shares the machine's cores with the agent and Redis, as in the other
benchmarks: read the ratio, not the absolute figures.

Two more figures explain the result: the agent's CPU time per decision for each
protocol (from /proc, so less sensitive to the machine's other load than the
rates), and, measured in the same rounds by the same client, a do-nothing
``grpc.aio`` servicer in a process of its own (a constant answer, no Redis): the
most that grpc.aio serves here, and what each RPC costs it before any decision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from geolimit.store.embedded import EmbeddedRedis

TARGET_RATIO = 2.0
SUBJECTS = 1000
HUGE = 1_000_000_000

REGION_TOML = """
[region]
name = "bench"
redis_url = "{redis}"
listen = "127.0.0.1:0"
secret_file = "gossip.key"
rls_listen = "127.0.0.1:0"
rls_config = "ratelimit.yaml"

[gossip]
peers = []

[[rule]]
name = "api"
limit = {huge}
window = 3600
resolution = 360
"""
RATELIMIT_YAML = """
domain: bench
descriptors:
  - key: user
    rate_limit: {{unit: hour, requests_per_unit: {huge}}}
"""


def start_agent(folder: Path, redis_url: str) -> tuple[subprocess.Popen[str], str, str]:
    """``geolimit agent`` on loopback; its HTTP URL and gRPC target, read from its log."""
    (folder / "gossip.key").write_text(secrets.token_urlsafe(32))
    (folder / "ratelimit.yaml").write_text(RATELIMIT_YAML.format(huge=HUGE))
    (folder / "region.toml").write_text(REGION_TOML.format(redis=redis_url, huge=HUGE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "geolimit.cli", "agent", "--config", str(folder / "region.toml")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    assert proc.stderr is not None
    http = target = None
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while (http is None or target is None) and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(r"listening on (http://[0-9.]+:\d+)", line):
            http = m.group(1)
        if m := re.search(r"rate limit service \(Envoy RLS v3\) on ([0-9.]+:\d+)", line):
            target = m.group(1)
    if http is None or target is None:
        proc.kill()
        raise SystemExit("the agent did not start:\n" + "".join(seen))
    # Keep reading its log so that a full pipe never blocks the agent.
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, http, target


async def timed(worker: Callable[[int], Awaitable[int]], concurrency: int) -> float:
    started = time.perf_counter()
    counts = await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return sum(counts) / (time.perf_counter() - started)


async def grpc_rate(target: str, seconds: float, concurrency: int) -> float:
    requests = []
    for n in range(SUBJECTS):
        req = rls_pb2.RateLimitRequest(domain="bench")
        req.descriptors.add().entries.add(key="user", value=f"u{n}")
        requests.append(req)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        first = await stub.ShouldRateLimit(requests[0])
        assert first.overall_code == rls_pb2.RateLimitResponse.OK, first
        assert first.statuses[0].HasField("current_limit"), "the descriptor must match a limit"
        stop = time.perf_counter() + seconds

        async def worker(n: int) -> int:
            done = 0
            while time.perf_counter() < stop:
                await stub.ShouldRateLimit(requests[(n + done * concurrency) % SUBJECTS])
                done += 1
            return done

        return await timed(worker, concurrency)


async def http_rate(url: str, seconds: float, concurrency: int) -> float:
    bodies = [json.dumps({"rule": "api", "subject": f"u{n}"}).encode() for n in range(SUBJECTS)]
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.post(url + "/v1/check", data=bodies[0], headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            assert answer["allowed"], answer
        stop = time.perf_counter() + seconds

        async def worker(n: int) -> int:
            done = 0
            while time.perf_counter() < stop:
                async with http.post(url + "/v1/check", data=bodies[(n + done * concurrency) % SUBJECTS],
                                     headers=headers) as resp:
                    await resp.read()
                done += 1
            return done

        return await timed(worker, concurrency)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Constant:
    """The do-nothing servicer: one OK status with a limit, whatever is asked."""

    def __init__(self) -> None:
        answer = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
        answer.statuses.add(code=rls_pb2.RateLimitResponse.OK, limit_remaining=1).current_limit.requests_per_unit = 1
        self.answer = answer

    async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
        return self.answer


async def serve_floor() -> None:
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(_Constant(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(None)


async def measure(targets: dict[str, str], pids: dict[str, int], rounds: int, seconds: float,
                  concurrency: int) -> dict[str, list[float]]:
    """Per round and kind: requests/s, and the serving process's CPU microseconds per request."""
    for kind, where in targets.items():  # warm-up: connections, scripts loaded, rules registered
        await (http_rate(where, 0.5, concurrency) if kind == "http" else grpc_rate(where, 0.5, concurrency))
    out: dict[str, list[float]] = {}
    for n in range(rounds):
        order = list(targets) if n % 2 == 0 else list(reversed(targets))
        for kind in order:
            cpu = cpu_seconds(pids[kind])
            rate = await (http_rate(targets[kind], seconds, concurrency) if kind == "http"
                          else grpc_rate(targets[kind], seconds, concurrency))
            out.setdefault(kind, []).append(rate)
            out.setdefault(f"{kind}_cpu_us", []).append((cpu_seconds(pids[kind]) - cpu) / (rate * seconds) * 1e6)
        print(f"  round {n + 1}: " + ", ".join(f"{k} {out[k][-1]:,.0f}/s ({out[k + '_cpu_us'][-1]:.0f} us CPU each)"
                                               for k in targets)
              + f" -> gRPC/HTTP {out['grpc'][-1] / out['http'][-1]:.2f}x", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        asyncio.run(serve_floor())
        return
    with EmbeddedRedis() as redis_server, tempfile.TemporaryDirectory() as tmp:
        proc, http, target = start_agent(Path(tmp), redis_server.url)
        floor = subprocess.Popen([sys.executable, __file__, "--serve-floor"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert floor.stdout is not None
            floor_target = f"127.0.0.1:{int(floor.stdout.readline())}"
            print(f"agent: HTTP {http}, gRPC {target}; do-nothing grpc.aio servicer {floor_target}; "
                  f"Redis {redis_server.version}; {args.concurrency} in flight, {args.seconds:g} s per "
                  f"measurement, {args.rounds} rounds")
            targets = {"grpc": target, "http": http, "grpc.aio floor": floor_target}
            pids = {"grpc": proc.pid, "http": proc.pid, "grpc.aio floor": floor.pid}
            rates = asyncio.run(measure(targets, pids, args.rounds, args.seconds, args.concurrency))
        finally:
            proc.terminate()
            proc.wait(10)
            floor.communicate(timeout=10)
    median = {k: statistics.median(v) for k, v in rates.items()}
    grpc_median, http_median = median["grpc"], median["http"]
    ratio = grpc_median / http_median
    verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
    print(f"gRPC ShouldRateLimit: {grpc_median:,.0f} decisions/s, agent CPU {median['grpc_cpu_us']:.0f} us "
          f"per decision (medians of {args.rounds})")
    print(f"HTTP /v1/check:       {http_median:,.0f} decisions/s, agent CPU {median['http_cpu_us']:.0f} us "
          f"per decision (same run)")
    print(f"do-nothing grpc.aio:  {median['grpc.aio floor']:,.0f} RPC/s, {median['grpc.aio floor_cpu_us']:.0f} us "
          f"CPU per RPC (same run: the ceiling of any grpc.aio service here)")
    print(f"ratio {ratio:.2f}x, goal >= {TARGET_RATIO:g}x: {verdict}")
    if args.json:
        report: dict[str, Any] = {
            "rates": rates, "medians": median,
            "ratio": ratio, "target": TARGET_RATIO, "verdict": verdict, "concurrency": args.concurrency,
            "seconds": args.seconds, "python": platform.python_version(),
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

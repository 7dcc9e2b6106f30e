"""Decisions per second of the agent's Envoy rate limit service (gRPC) against its HTTP ``/v1/check``.

    python bench/rls.py [--rounds 3] [--seconds 3] [--concurrency 64] [--no-floors] [--no-python] [--no-c]
                        [--json PATH]

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

The figures that explain the result: the CPU time per request of the serving
process and of this client (from /proc, so less sensitive to the machine's other
load than the rates), and, measured in the same rounds by the same clients,
do-nothing servers in processes of their own (a constant answer, no Redis): a
``grpc.aio`` servicer, ``grpc.server`` with a generic handler on raw bytes,
grpcio's core driven directly (``geolimit.server.rls.transport``, the agent's
transport with ``rls_fast_path = false``), the agent's HTTP/2 fast path
(``geolimit.server.rls.h2c``), and an aiohttp ``/v1/check`` handler; what
each way of serving costs per call before any decision (``--no-floors`` skips
them). Every measurement stops by itself after ``--seconds``.

Then the same comparison with a C load generator, h2load (``apt-get install
nghttp2-client``; ``bench/_rls_load.py``), so that the agent, not the client, is
measured: gRPC with ``--concurrency`` streams on one connection, against the
default agent (the HTTP/2 fast path) and a second agent with ``rls_fast_path =
false`` (grpcio's core), and ``/v1/check`` over HTTP/1.1 with ``--concurrency``
connections (one subject each; rounds alternate the order). Each answer is
checked against the agent's ``/metrics`` (one allowed decision per 2xx answer).
The verdict compares the h2load rates (the Python-client rows' ratio is printed
too). ``--no-python`` and ``--no-c`` skip either part.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
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

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # forks (exec) beside grpcio's threads: tests/conftest.py

import aiohttp
import grpc
import grpc.aio
from aiohttp import web
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's geolimit, wherever the bench is run from

from bench._rls_load import C_NAMES, measure_c, missing_tools  # noqa: E402
from geolimit.server.rls.h2c import FastCall, FastServer  # noqa: E402
from geolimit.server.rls.server import METHOD, SERVICE  # noqa: E402
from geolimit.server.rls.transport import UnaryCall, UnaryServer  # noqa: E402
from geolimit.store.embedded import EmbeddedRedis  # noqa: E402

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
rls_fast_path = {fast}

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


def start_agent(folder: Path, redis_url: str, fast: bool = True) -> tuple[subprocess.Popen[str], str, str]:
    """``geolimit agent`` on loopback; its HTTP URL and gRPC target, read from its log."""
    folder.mkdir(exist_ok=True)
    (folder / "gossip.key").write_text(secrets.token_urlsafe(32))
    (folder / "ratelimit.yaml").write_text(RATELIMIT_YAML.format(huge=HUGE))
    (folder / "region.toml").write_text(REGION_TOML.format(redis=redis_url, huge=HUGE, fast=str(fast).lower()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "geolimit.cli", "agent", "--config", str(folder / "region.toml")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,  # -m: this checkout's geolimit
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


def _constant() -> bytes:
    """The do-nothing answer: one OK status with a limit, whatever is asked."""
    answer = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)
    answer.statuses.add(code=rls_pb2.RateLimitResponse.OK, limit_remaining=1).current_limit.requests_per_unit = 1
    data: bytes = answer.SerializeToString()
    return data


FLOORS = {  # do-nothing servers, one process each: what each way of serving costs before any decision
    "grpc.aio floor": "a grpc.aio servicer (Envoy's stubs, messages parsed)",
    "grpc.server floor": "grpc.server, 4 threads, a generic handler on raw bytes",
    "core floor": "grpcio's core driven directly (geolimit.server.rls.transport), request parsed",
    "h2c floor": "the agent's HTTP/2 fast path (geolimit.server.rls.h2c), request parsed",
    "aiohttp floor": "an aiohttp POST /v1/check handler, a constant JSON answer",
}


async def serve_floor(kind: str) -> None:
    """Serve one do-nothing server on loopback; print its port; stop when stdin closes."""
    raw = _constant()
    stopped = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    if kind == "grpc.aio floor":
        parsed = rls_pb2.RateLimitResponse.FromString(raw)

        class Constant:
            async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
                return parsed

        server = grpc.aio.server()
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Constant(), server)
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        await stopped
        await server.stop(None)
    elif kind == "grpc.server floor":
        pool = concurrent.futures.ThreadPoolExecutor(4)
        sync = grpc.server(pool)
        handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(lambda request, context: raw)
        sync.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ShouldRateLimit": handler}),))
        print(sync.add_insecure_port("127.0.0.1:0"), flush=True)
        sync.start()
        await stopped
        sync.stop(None)
    elif kind in ("core floor", "h2c floor"):
        def handle(call: UnaryCall | FastCall) -> None:
            rls_pb2.RateLimitRequest.FromString(call.request)
            call.reply(raw)

        if kind == "core floor":
            core = UnaryServer(METHOD, handle)
            print(core.bind("127.0.0.1:0"), flush=True)
            await core.start()
            await stopped
            await core.stop(None)
        else:
            fast = FastServer(METHOD, handle)
            print(await fast.listen("127.0.0.1", 0), flush=True)
            await stopped
            await fast.stop(None)
    else:
        body = json.dumps({"allowed": True, "limit": 1, "remaining": 1}).encode()

        async def check(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=body, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/check", check)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
        await stopped
        await runner.cleanup()


async def measure(targets: dict[str, str], pids: dict[str, int], rounds: int, seconds: float,
                  concurrency: int) -> dict[str, list[float]]:
    """Per round and kind: requests/s, and CPU microseconds per request of the server and of this client."""

    def run(kind: str, span: float) -> Awaitable[float]:
        http = kind in ("http", "aiohttp floor")
        return (http_rate if http else grpc_rate)(targets[kind], span, concurrency)

    for kind in targets:  # warm-up: connections, scripts loaded, rules registered
        await run(kind, 0.5)
    out: dict[str, list[float]] = {}
    me = os.getpid()
    for n in range(rounds):
        order = list(targets) if n % 2 == 0 else list(reversed(targets))
        for kind in order:
            cpu, mine = cpu_seconds(pids[kind]), cpu_seconds(me)
            rate = await run(kind, seconds)
            out.setdefault(kind, []).append(rate)
            out.setdefault(f"{kind}_cpu_us", []).append((cpu_seconds(pids[kind]) - cpu) / (rate * seconds) * 1e6)
            out.setdefault(f"{kind}_client_us", []).append((cpu_seconds(me) - mine) / (rate * seconds) * 1e6)
        print(f"  round {n + 1}: " + ", ".join(f"{k} {out[k][-1]:,.0f}/s ({out[k + '_cpu_us'][-1]:.0f} us)"
                                               for k in targets)
              + f" -> gRPC/HTTP {out['grpc'][-1] / out['http'][-1]:.2f}x", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--no-floors", action="store_true", help="only the agent's two protocols")
    parser.add_argument("--no-python", action="store_true", help="skip the Python clients")
    parser.add_argument("--no-c", action="store_true", help="skip h2load")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve-floor", choices=list(FLOORS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        asyncio.run(serve_floor(args.serve_floor))
        return
    missing = None if args.no_c else missing_tools()
    if missing:
        print(f"{missing}; the h2load rows are skipped", flush=True)
    floors: dict[str, subprocess.Popen[str]] = {}
    report: dict[str, Any] = {"concurrency": args.concurrency, "seconds": args.seconds,
                              "python": platform.python_version(), "target": TARGET_RATIO}
    with EmbeddedRedis() as redis_server, tempfile.TemporaryDirectory() as tmp:
        proc, http, target = start_agent(Path(tmp) / "fast", redis_server.url)
        core = None
        try:
            print(f"agent: HTTP {http}, gRPC {target}; Redis {redis_server.version}; {args.concurrency} in flight, "
                  f"{args.seconds:g} s per measurement, {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
            if not args.no_python:
                report["python_clients"] = python_clients(args, proc.pid, http, target, floors)
            if not args.no_c and not missing:
                core, core_http, core_target = start_agent(Path(tmp) / "core", redis_server.url, fast=False)
                targets = {"grpc": (target, http), "grpc core": (core_target, core_http), "http": (http, http)}
                pids = {"grpc": proc.pid, "grpc core": core.pid, "http": proc.pid}
                cpus = {k: (lambda pid=pid: [cpu_seconds(pid), cpu_seconds(redis_server.pid)]) for k, pid in pids.items()}
                print(f"h2load: agent {target} (fast path), {core_target} (grpcio's core); load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                report["h2load"] = c_clients(measure_c(targets, cpus, Path(tmp), args.rounds, args.seconds,
                                                       args.concurrency), args.rounds)
        finally:
            for agent in (proc, core):
                if agent is not None:
                    agent.terminate()
                    agent.wait(10)
            for floor in floors.values():
                floor.communicate(timeout=10)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def python_clients(args: argparse.Namespace, pid: int, http: str, target: str,
                   floors: dict[str, subprocess.Popen[str]]) -> dict[str, Any]:
    """The Python-client rows (this process is the client), with the do-nothing floors; printed, returned."""
    targets, pids = {"grpc": target, "http": http}, {"grpc": pid, "http": pid}
    for kind in [] if args.no_floors else list(FLOORS):
        floor = floors[kind] = subprocess.Popen([sys.executable, __file__, "--serve-floor", kind],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert floor.stdout is not None
        port = int(floor.stdout.readline())
        targets[kind] = f"http://127.0.0.1:{port}" if kind == "aiohttp floor" else f"127.0.0.1:{port}"
        pids[kind] = floor.pid
    rates = asyncio.run(measure(targets, pids, args.rounds, args.seconds, args.concurrency))
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["grpc"] / median["http"]
    print(f"Python clients, medians of {args.rounds} rounds; CPU per request of the serving process and of this client:")
    names = {"grpc": "gRPC ShouldRateLimit (agent, fast path)", "http": "HTTP /v1/check (agent)"} | FLOORS
    for kind in targets:
        print(f"  {median[kind]:8,.0f}/s  server {median[kind + '_cpu_us']:4.0f} us  client "
              f"{median[kind + '_client_us']:4.0f} us  {names[kind]}")
    print(f"Python clients: ratio {ratio:.2f}x; load average {os.getloadavg()[0]:.1f}", flush=True)
    return {"rates": rates, "medians": median, "ratio": ratio}


def c_clients(rates: dict[str, list[float]], rounds: int) -> dict[str, Any]:
    """The h2load rows and the verdict; printed, returned."""
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["grpc"] / median["http"]
    verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
    print(f"h2load, medians of {rounds} rounds; CPU per decision of the agent and of Redis:")
    for kind in rates:
        if not kind.endswith("_us"):
            print(f"  {median[kind]:8,.0f}/s  agent {median[kind + '_cpu_us']:4.0f} us  Redis "
                  f"{median[kind + '_redis_us']:4.0f} us  {C_NAMES[kind]}")
    print(f"ratio {ratio:.2f}x (grpcio's core: {median['grpc core'] / median['http']:.2f}x), goal >= "
          f"{TARGET_RATIO:g}x: {verdict}; load average {os.getloadavg()[0]:.1f}", flush=True)
    return {"rates": rates, "medians": median, "ratio": ratio, "verdict": verdict}


if __name__ == "__main__":
    main()

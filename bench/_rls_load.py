"""C load generators for ``bench/rls.py``: h2load (nghttp2) for gRPC and for HTTP/1.1 ``/v1/check``.

With a Python client on the same 2 cores the client costs as much CPU per call
as the server, so the rates measure both. h2load spends a few microseconds per
call: what is measured is the agent (and Redis). Every run has a fixed duration
(``-D``) and a loopback target; the answers are checked, not only counted: the
agent's own ``/metrics`` must have counted one allowed decision per 2xx answer
(a gRPC error still has HTTP status 200, so h2load's count alone proves nothing).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from envoy.service.ratelimit.v3 import rls_pb2

__all__ = ["C_NAMES", "INSTALL", "Load", "measure_c", "missing_tools", "run_load", "write_bodies"]

INSTALL = "h2load is missing: apt-get install nghttp2-client (Debian/Ubuntu), or brew install nghttp2"
GRPC_PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
_RESULT = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                     r"(\d+) errored, (\d+) timeout")
_CODES = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


def missing_tools() -> str | None:
    """None if h2load is on PATH, else how to install it."""
    return None if shutil.which("h2load") else INSTALL


def write_bodies(folder: Path) -> tuple[Path, Path]:
    """The gRPC request (5-byte prefix and a RateLimitRequest) and the JSON body, one subject each."""
    request = rls_pb2.RateLimitRequest(domain="bench")
    request.descriptors.add().entries.add(key="user", value="h2load")
    message = request.SerializeToString()
    grpc_body = folder / "request.grpc"
    grpc_body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
    json_body = folder / "request.json"
    json_body.write_text(json.dumps({"rule": "api", "subject": "h2load"}))
    return grpc_body, json_body


@dataclass(frozen=True)
class Load:
    """What one h2load run measured."""

    rate: float  # 2xx answers per second
    ok: int  # 2xx answers
    failed: int  # non-2xx, failed, errored or timed-out requests
    decisions: int  # allowed decisions the agent counted meanwhile (``ok``, plus calls cut off at the end)


def h2load_command(kind: str, url: str, body: Path, seconds: float, concurrency: int) -> list[str]:
    """``grpc``: one connection, ``concurrency`` streams; ``http``: HTTP/1.1, ``concurrency`` connections."""
    base = ["h2load", "-D", f"{seconds:g}", "-d", str(body)]
    if kind == "http":
        return [*base, "--h1", "-c", str(concurrency), "-m", "1", "-H", "content-type: application/json",
                url + "/v1/check"]
    return [*base, "-c", "1", "-m", str(concurrency), "-H", "content-type: application/grpc",
            "-H", "te: trailers", f"http://{url}{GRPC_PATH}"]


def allowed_count(metrics_url: str, kind: str) -> int:
    """Allowed decisions so far, from the agent's /metrics: RLS ``ok`` results or ``/v1/check`` allowed."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as resp:  # loopback only
        text = resp.read().decode()
    family, labels = (("geolimit_decisions_total{", ('rule="api"', 'result="allowed"')) if kind == "http"
                      else ("geolimit_rls_decisions_total{", ('domain="bench"', 'result="ok"')))
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(family) and all(label in line for label in labels)))


def run_load(kind: str, url: str, metrics_url: str, body: Path, seconds: float, concurrency: int,
             cpu: Callable[[], list[float]]) -> tuple[Load, list[float]]:
    """One h2load run; its result and the CPU seconds of each process ``cpu`` reads, spent during it."""
    before_decisions = allowed_count(metrics_url, kind)
    before_cpu = cpu()
    done = subprocess.run(h2load_command(kind, url, body, seconds, concurrency), capture_output=True, text=True,
                          timeout=seconds + 60, check=False)
    spent = [b - a for a, b in zip(before_cpu, cpu(), strict=True)]
    decisions = allowed_count(metrics_url, kind) - before_decisions
    result, codes = _RESULT.search(done.stdout), _CODES.search(done.stdout)
    rate = re.search(r"finished in ([0-9.]+)s, ([0-9.]+) req/s", done.stdout)
    if done.returncode != 0 or result is None or codes is None or rate is None:
        raise SystemExit(f"h2load failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    ok, started = int(codes.group(1)), int(result.group(2))
    failed = sum(int(result.group(i)) for i in (5, 6, 7)) + sum(int(g) for g in codes.groups()[1:])
    # The agent also decides the calls cut off at the end, and h2load may send a few before its clock starts.
    if failed or not ok <= decisions <= started + concurrency:
        raise SystemExit(f"{kind}: h2load had {ok} 2xx answers and {failed} failures of {started} started, "
                         f"but the agent counted {decisions} allowed decisions: the answers are not decisions\n"
                         + done.stdout)
    return Load(float(rate.group(2)), ok, failed, decisions), spent


C_NAMES = {
    "grpc": "gRPC ShouldRateLimit, the agent (HTTP/2 fast path), h2load: 1 connection",
    "grpc core": "gRPC ShouldRateLimit, an agent with rls_fast_path = false (grpcio's core), h2load",
    "http": "HTTP/1.1 POST /v1/check, the agent, h2load --h1: one connection per request in flight",
}


def measure_c(targets: dict[str, tuple[str, str]], cpus: dict[str, Callable[[], list[float]]], folder: Path,
              rounds: int, seconds: float, concurrency: int) -> dict[str, list[float]]:
    """Per kind (``C_NAMES``) and round: rates, and agent and Redis CPU microseconds per decision.

    ``targets[kind]`` is (where h2load sends, the agent's HTTP URL for /metrics).
    """
    grpc_body, json_body = write_bodies(folder)
    bodies = {"grpc": grpc_body, "grpc core": grpc_body, "http": json_body}

    def one(kind: str, span: float) -> tuple[Load, list[float]]:
        url, metrics = targets[kind]
        return run_load("http" if kind == "http" else "grpc", url, metrics, bodies[kind], span, concurrency, cpus[kind])

    for kind in targets:  # warm-up
        one(kind, 1.0)
    out: dict[str, list[float]] = {}
    for n in range(rounds):
        for kind in list(targets) if n % 2 == 0 else list(reversed(targets)):
            load, (agent, redis) = one(kind, seconds)
            out.setdefault(kind, []).append(load.rate)
            out.setdefault(f"{kind}_cpu_us", []).append(agent / load.decisions * 1e6)
            out.setdefault(f"{kind}_redis_us", []).append(redis / load.decisions * 1e6)
        print(f"  round {n + 1}: " + ", ".join(
            f"{k} {out[k][-1]:,.0f}/s (agent {out[k + '_cpu_us'][-1]:.0f} us, Redis {out[k + '_redis_us'][-1]:.0f} us)"
            for k in targets) + f" -> gRPC/HTTP {out['grpc'][-1] / out['http'][-1]:.2f}x", flush=True)
    return out

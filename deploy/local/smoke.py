#!/usr/bin/env python3
"""Readiness waits and the smoke test of the local 3-region layout (used by run.sh).

    python smoke.py wait  --state DIR --stage redis|agent|app|proxy [--timeout S]
    python smoke.py smoke --state DIR [--no-proxy] [--timeout S]

``wait`` polls every component of a stage until it answers (Redis: PING; agent:
/readyz; app: /healthz; proxy: the admin /readyz), with a deadline, and fails at
once, with the end of its log, if one of the processes has exited.

``smoke`` checks that the global limit holds across the three regions, exactly. It
takes the rule and key of the proxies' ``/tenant/*`` route (rule ``tenant``, 30 per
5 minutes, keyed by the ``X-Tenant`` header) and a fresh tenant name, then for each
region in turn sends a batch of 40 % of the limit through that region's proxy (or,
with --no-proxy, to its agent's /v1/check), so the batches are 12, 12 and 12 and only
6 of the last fit. After each batch it checks the exact number allowed, then waits
until every agent reports the same global count and per-region breakdown (so the next
region decides on replicated counts, not on luck). Then every region must deny, the
apps must have seen exactly the allowed requests, and every metric the Grafana
dashboard uses must be exposed. Prints one line per check and PASS or FAIL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parent.parent
DASHBOARD = DEPLOY / "grafana" / "geolimit-dashboard.json"
SMOKE_PATH = "/tenant/orders"
POLL = 0.05


class Failed(Exception):
    pass


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any


def http(method: str, url: str, body: object = None, headers: Mapping[str, str] | None = None,
         timeout: float = 5.0) -> Reply:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, got, raw = resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as exc:
        status, got, raw = exc.code, dict(exc.headers.items()), exc.read()
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    return Reply(status, got, parsed)


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode("utf-8", "replace"))


# -- the run's state --------------------------------------------------------------


@dataclass
class State:
    root: Path
    plan: list[dict[str, Any]]
    token: str
    pids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path) -> State:
        plan = json.loads((root / "plan.json").read_text())["regions"]
        token = (root / "secrets" / "api_token").read_text().strip()
        state = cls(root, plan, token)
        pid_file = root / "pids"
        if pid_file.exists():
            for line in pid_file.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2:
                    state.pids[parts[0]] = int(parts[1])
        return state

    def config(self, region: str, kind: str) -> dict[str, Any]:
        data: dict[str, Any] = tomllib.loads((self.root / "config" / region / f"{kind}.toml").read_text())
        return data

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.root / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "<empty>"
        except OSError:
            return f"<no log at {path}>"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited too
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# -- wait --------------------------------------------------------------------------


def redis_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        return http("GET", url, timeout=1.0).status == 200
    except (OSError, ValueError):
        return False


def probe(stage: str, r: dict[str, Any]) -> Callable[[], bool]:
    """Whether one component of a stage answers."""
    if stage == "redis":
        return lambda: redis_ping(r["redis_host"], r["redis_port"])
    if stage == "agent":
        return lambda: http_ok(r["api_url"] + "/readyz") and http_ok(r["agent_url"] + "/readyz")
    if stage == "app":
        return lambda: http_ok(f"http://{r['app_host']}:{r['app_port']}/healthz")
    if stage == "proxy":
        return lambda: http_ok(r["admin_url"] + "/readyz")
    raise Failed(f"unknown stage {stage!r}")


def probes(state: State, stage: str) -> dict[str, Callable[[], bool]]:
    return {f"{stage}-{r['region']}": probe(stage, r) for r in state.plan}


def wait(state: State, stage: str, timeout: float) -> None:
    pending = probes(state, stage)
    started = time.monotonic()
    deadline = started + timeout
    while pending:
        for name in list(pending):
            pid = state.pids.get(name)
            if pid is not None and not alive(pid):
                raise Failed(f"{name} (pid {pid}) exited while starting; end of its log:\n{state.log_tail(name)}")
            if pending[name]():
                del pending[name]
        if not pending:
            break
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{state.log_tail(n)}" for n in pending)
            raise Failed(f"not ready within {timeout:.0f}s: {', '.join(pending)}\n{tails}")
        time.sleep(POLL)
    print(f"  {stage:<6} ready in {time.monotonic() - started:.2f}s", flush=True)


# -- smoke -------------------------------------------------------------------------


def eventually(check: Callable[[], str | None], timeout: float, what: str) -> float:
    """Poll ``check`` (None: satisfied, else why not) until the deadline; the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        reason = check()
        if reason is None:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise Failed(f"{what}: still not true after {timeout:.0f}s: {reason}")
        time.sleep(POLL)


def metric_names(exposition: str) -> set[str]:
    """Sample names of a Prometheus text exposition, plus those its # TYPE lines promise."""
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",)}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names.update(family + s for s in suffixes.get(kind.strip(), ("",)))
            names.add(family)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def samples(exposition: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric: (labels, value)."""
    out = []
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", exposition, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
        out.append((labels, float(match.group(2))))
    return out


def count(exposition: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for found, v in samples(exposition, name) if labels.items() <= found.items())


def dashboard_metrics(path: Path = DASHBOARD) -> set[str]:
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(path.read_text()))
    return {name for expr in exprs for name in re.findall(r"\bgeolimit_[a-z0-9_]+\b", expr)}


@dataclass
class Smoke:
    state: State
    with_proxy: bool
    timeout: float
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, message: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {message}", flush=True)
        if not ok:
            self.failures.append(message)

    def limit_spec(self) -> tuple[str, str, int]:
        """(rule, key, limit) of the /tenant/* route."""
        first = self.state.plan[0]["region"]
        rule, key = "tenant", "header:X-Tenant"
        if self.with_proxy:
            routes = self.state.config(first, "proxy").get("route", [])
            found = [r for r in routes if r.get("path") == "/tenant/*"]
            if not found:
                raise Failed("the proxy config has no /tenant/* route")
            rule, key = found[0]["limits"][0]["rule"], found[0]["limits"][0]["key"]
        rules = {r["name"]: r for r in self.state.config(first, "agent")["rule"]}
        from geolimit.core.rule import parse_rate

        limit, _ = parse_rate(rules[rule]["limit"])
        return rule, key, limit

    def subject(self, key: str, tenant: str) -> str:
        from geolimit.http.keys import KeySpec, RequestInfo

        header = key.partition(":")[2]
        request = RequestInfo("GET", SMOKE_PATH, {header.lower(): tenant}, "127.0.0.1")
        return KeySpec(key).subject(request, {}, "/tenant/*", ())

    def send(self, region: dict[str, Any], rule: str, key: str, tenant: str, subject: str) -> bool:
        """One request in ``region``; whether it was allowed (anything else unexpected fails)."""
        if self.with_proxy:
            header = key.partition(":")[2]
            reply = http("GET", region["proxy_url"] + SMOKE_PATH, headers={header: tenant})
            if reply.status == 200:
                if not (isinstance(reply.body, dict) and reply.body.get("region") == region["region"]):
                    raise Failed(f"{region['region']}: an allowed request was not answered by its app: {reply.body!r}")
                return True
            if reply.status == 429:
                lowered = {k.lower() for k in reply.headers}
                if not {"retry-after", "ratelimit", "ratelimit-policy"} <= lowered:
                    raise Failed(f"{region['region']}: a 429 without Retry-After and RateLimit headers: "
                                 f"{reply.headers}")
                return False
            raise Failed(f"{region['region']}: proxy answered {reply.status}: {reply.body!r}")
        reply = http("POST", region["api_url"] + "/v1/check", {"rule": rule, "subject": subject},
                     headers=self.state.auth)
        if reply.status != 200 or not isinstance(reply.body, dict):
            raise Failed(f"{region['region']}: /v1/check answered {reply.status}: {reply.body!r}")
        return bool(reply.body["allowed"])

    def usage(self, region: dict[str, Any], rule: str, subject: str) -> dict[str, Any]:
        query = urllib.parse.urlencode({"rule": rule, "subject": subject})
        reply = http("GET", f"{region['api_url']}/v1/usage?{query}", headers=self.state.auth)
        if reply.status != 200 or not isinstance(reply.body, dict):
            raise Failed(f"{region['region']}: /v1/usage answered {reply.status}: {reply.body!r}")
        return reply.body

    def converged(self, rule: str, subject: str, expected: dict[str, int]) -> str | None:
        want = {k: v for k, v in expected.items() if v}
        for region in self.state.plan:
            got = self.usage(region, rule, subject)
            regions = {k: v for k, v in got.get("regions", {}).items() if v}
            if got.get("total") != sum(want.values()) or regions != want:
                return f"{region['region']} sees total={got.get('total')} by region {regions}, want {want}"
        return None

    def run(self) -> None:
        plan = self.state.plan
        rule, key, limit = self.limit_spec()
        tenant = "smoke-" + secrets.token_hex(4)
        subject = self.subject(key, tenant)
        batch = math.ceil(limit * 0.4)
        via = "proxies" if self.with_proxy else "agents' /v1/check (--no-proxy)"
        print(f"smoke: rule {rule!r} (limit {limit}), key {key!r}, tenant {tenant}, via the {via}", flush=True)
        allowed: dict[str, int] = {r["region"]: 0 for r in plan}
        for region in plan:
            before = sum(allowed.values())
            want = min(batch, max(0, limit - before))
            got = sum(self.send(region, rule, key, tenant, subject) for _ in range(batch))
            allowed[region["region"]] = got
            self.check(got == want, f"{region['region']}: {got} of {batch} allowed (want {want}; "
                                    f"{before} already used world-wide)")
            took = eventually(lambda: self.converged(rule, subject, allowed), self.timeout,
                              "replication to every region")
            self.check(True, f"every region counts {sum(allowed.values())} "
                             f"({', '.join(f'{k}={v}' for k, v in allowed.items())}) after {took:.2f}s")
        total = sum(allowed.values())
        self.check(total == limit, f"{total} allowed world-wide, the limit is {limit}")
        extra = [region["region"] for region in plan if self.send(region, rule, key, tenant, subject)]
        self.check(not extra, "every region denies once the limit is used up"
                              + (f" (allowed in: {', '.join(extra)})" if extra else ""))
        if self.with_proxy:
            for region in plan:
                stats = http("GET", f"http://{region['app_host']}:{region['app_port']}/stats").body
                served = stats.get("by_path", {}).get(SMOKE_PATH, 0) if isinstance(stats, dict) else None
                self.check(served == allowed[region["region"]],
                           f"{region['region']}: the app served {served} (the allowed ones only)")
        self.check_metrics(allowed, batch + 1, rule)

    def check_metrics(self, allowed: dict[str, int], sent: int, rule: str) -> None:
        """Each region's decisions as its metrics count them, and the dashboard's metrics exposed."""
        exposed: set[str] = set()
        for region in self.state.plan:
            name = region["region"]
            text = http_text(region["agent_url"] + "/metrics")
            exposed |= metric_names(text)
            peers = {labels.get("peer") for labels, _ in samples(text, "geolimit_peer_lag_seconds")}
            others = {r["region"] for r in self.state.plan} - {name}
            self.check(peers == others, f"{name}: the agent reports gossip lag for peers {sorted(map(str, peers))}")
            if self.with_proxy:
                text = http_text(region["admin_url"] + "/metrics")
                exposed |= metric_names(text)
                metric = "geolimit_proxy_decisions_total"
            else:
                metric = "geolimit_decisions_total"
            ok = count(text, metric, rule=rule, result="allowed")
            denied = count(text, metric, rule=rule, result="denied")
            want = (allowed[name], sent - allowed[name])
            self.check((ok, denied) == want, f"{name}: {metric} counts {ok:g} allowed and {denied:g} denied "
                                             f"(want {want[0]} and {want[1]})")
        wanted = dashboard_metrics()
        if not self.with_proxy:
            wanted = {m for m in wanted if not m.startswith("geolimit_proxy_")}
        missing = sorted(wanted - exposed)
        self.check(not missing, f"the {len(wanted)} metrics of the Grafana dashboard are exposed"
                                + (f"; missing: {', '.join(missing)}" if missing else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="readiness waits and the smoke test of deploy/local")
    parser.add_argument("command", choices=("wait", "smoke"))
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--stage", choices=("redis", "agent", "app", "proxy"))
    parser.add_argument("--no-proxy", action="store_true")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each wait, seconds")
    args = parser.parse_args(argv)
    state = State.load(args.state)
    try:
        if args.command == "wait":
            if args.stage is None:
                parser.error("wait needs --stage")
            wait(state, args.stage, args.timeout)
            return 0
        smoke = Smoke(state, not args.no_proxy, args.timeout)
        started = time.monotonic()
        smoke.run()
    except (Failed, OSError) as exc:
        print(f"{args.command}: FAIL: {exc}", file=sys.stderr, flush=True)
        return 1
    took = time.monotonic() - started
    if smoke.failures:
        print(f"smoke: FAIL: {len(smoke.failures)} check(s) failed ({took:.1f}s)", flush=True)
        return 1
    print(f"smoke: PASS ({took:.1f}s of traffic and checks)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

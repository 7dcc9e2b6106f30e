"""``geolimit try`` and ``geolimit redis``: the commands that run against a local Redis.

Their arguments are checked while parsing (geolimit/cli_args.py): a bad rate, region
name or ``--host`` is a usage error (exit 2) before any redis-server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

__all__ = ["NO_REDIS_HINT", "cmd_redis", "cmd_try", "host_warning"]


#: What to try when ``geolimit try`` finds no Redis at ``--redis``.
NO_REDIS_HINT = ("no Redis answers there: add --embedded for a throwaway redis-server, or start one with "
                 "`geolimit redis` (it prints its URL) and pass that URL with --redis URL")


def cmd_try(args: argparse.Namespace) -> int:
    """Hit a rule a few times against a Redis and print the decisions."""
    from geolimit import Limiter, Rule
    from geolimit.core.rule import window_label
    from geolimit.errors import StorageError

    rules = Rule.parse_many(args.rule_name, args.rate)  # "10/hour;5/minute": all-or-nothing over both
    with contextlib.ExitStack() as stack:
        url = args.redis
        if args.embedded:
            from geolimit.store.embedded import EmbeddedRedis

            url = stack.enter_context(EmbeddedRedis()).url
            print(f"embedded redis-server at {url} (stopped on exit)")
        limiter = stack.enter_context(Limiter.from_url(url, region=args.region, rules=rules))
        for _ in range(args.times):
            try:
                d = limiter.hit([r.name for r in rules], args.subject, cost=args.cost)
            except StorageError as exc:
                if args.embedded or not str(exc).startswith("Redis unreachable"):
                    raise
                print(f"geolimit: error: {exc}\n  {NO_REDIS_HINT}", file=sys.stderr)
                return 1
            retry = "never" if math.isinf(d.retry_after) else f"{d.retry_after:.3f}s"
            print(
                f"{'allowed' if d.allowed else 'denied '}  {d.rule}  remaining={d.remaining:<6} "
                f"retry_after={retry} reset_after={d.reset_after:.3f}s"
            )
    for rule in rules:
        if args.cost > rule.limit:
            print(f"note: the cost {args.cost} exceeds the limit of rule {rule.name!r} ({rule.limit} per "
                  f"{window_label(rule.window)}): a hit of this cost is never allowed (retry_after=never)")
    return 0


def host_warning(host: str) -> str | None:
    """None when ``host`` (a local address, see cli_args.local_host) is loopback; else why binding it is exposed."""
    import ipaddress
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as redis-server binds it
    try:
        addresses = {ipaddress.ip_address(str(info[4][0]).partition("%")[0])
                     for info in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)}
    except (OSError, ValueError):
        addresses = set()
    if addresses and all(address.is_loopback for address in addresses):
        return None
    where = ("every network interface" if any(a.is_unspecified for a in addresses)
             else "a network interface, not loopback")
    return (f"geolimit: warning: --host {host} is not a loopback address: this redis-server (no password) "
            f"listens on {where}, where other machines may reach it")


def cmd_redis(args: argparse.Namespace) -> int:
    """Run an embedded redis-server on loopback, print its URL, stop it on Ctrl-C or SIGTERM."""
    import signal
    import threading

    from geolimit.store.embedded import EmbeddedRedis
    from geolimit.store.embedded.server import PortInUseError, tail

    warning = host_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = EmbeddedRedis(host=args.host, port=args.port)
    try:
        try:
            server.start()
        except PortInUseError as exc:
            print(f"geolimit: error: port {exc.port} on {exc.host} is already in use by another process; "
                  "pick another with --port N, or leave --port out to get a free one", file=sys.stderr)
            return 1
        with server:  # started: entering only arranges the stop
            print(server.url, flush=True)
            print(f"redis-server {server.version} (pid {server.pid}); Ctrl-C stops it", file=sys.stderr, flush=True)
            try:
                while not stop.wait(0.5):
                    if not server.running:
                        print(f"geolimit: error: redis-server exited; log:\n{tail(server.log_path)}", file=sys.stderr)
                        return 1
            except KeyboardInterrupt:
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0

"""``geolimit try`` and ``geolimit redis``: the commands that run against a local Redis.

Their arguments are checked while parsing (geolimit/cli_args.py): a bad rate, region
name or ``--host`` is a usage error (exit 2) before any redis-server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

__all__ = ["cmd_redis", "cmd_try", "host_warning"]


def cmd_try(args: argparse.Namespace) -> int:
    """Hit a rule a few times against a Redis and print the decisions."""
    from geolimit import Limiter, Rule

    rules = Rule.parse_many(args.rule_name, args.rate)  # "10/hour;5/minute": all-or-nothing over both
    with contextlib.ExitStack() as stack:
        url = args.redis
        if args.embedded:
            from geolimit.store.embedded import EmbeddedRedis

            url = stack.enter_context(EmbeddedRedis()).url
            print(f"embedded redis-server at {url} (stopped on exit)")
        limiter = stack.enter_context(Limiter.from_url(url, region=args.region, rules=rules))
        for _ in range(args.times):
            d = limiter.hit([r.name for r in rules], args.subject, cost=args.cost)
            print(
                f"{'allowed' if d.allowed else 'denied '}  {d.rule}  remaining={d.remaining:<6} "
                f"retry_after={d.retry_after:.3f}s reset_after={d.reset_after:.3f}s"
            )
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

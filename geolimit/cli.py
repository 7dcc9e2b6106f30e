"""The ``geolimit`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from geolimit import __version__
from geolimit.errors import GeolimitError

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _cmd_try(args: argparse.Namespace) -> int:
    """Hit a rule a few times against a Redis and print the decisions."""
    from geolimit import Limiter, Rule

    rule = Rule.from_string(args.rule_name, args.rate)
    with Limiter.from_url(args.redis, region=args.region, rules=[rule]) as limiter:
        for _ in range(args.times):
            d = limiter.hit(rule.name, args.subject, cost=args.cost)
            print(
                f"{'allowed' if d.allowed else 'denied '}  remaining={d.remaining:<6} "
                f"retry_after={d.retry_after:.3f}s reset_after={d.reset_after:.3f}s"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geolimit", description="Multi-region rate limiter on Redis.")
    parser.add_argument("--version", action="version", version=f"geolimit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("try", help="hit a rule against a Redis and print the decisions")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL (default: %(default)s)")
    p.add_argument("--region", default="local", help="region name (default: %(default)s)")
    p.add_argument("--rule-name", default="try", help="rule name (default: %(default)s)")
    p.add_argument("--times", type=int, default=5, help="how many hits (default: %(default)s)")
    p.add_argument("--cost", type=int, default=1)
    p.add_argument("rate", help="rate string such as 5/10s or '100 per minute'")
    p.add_argument("subject", help="who is limited, such as user:42")
    p.set_defaults(handler=_cmd_try)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except GeolimitError as exc:
        print(f"geolimit: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Rate limits for plain functions: the @limited decorator and the limit() context managers.

    python examples/decorated.py [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio

from geolimit import AsyncLimiter, Limiter, Rule
from geolimit.decorators import RateLimited, alimit, limit, limited
from geolimit.store.embedded import EmbeddedRedis

RULES = [Rule("calls", limit=3, window=10), Rule("tokens", limit=100, window=60)]


def sync_part(url: str) -> None:
    with Limiter.from_url(url, region="local", rules=RULES) as limiter:

        @limited(limiter, "calls", subject=lambda user: f"user:{user}")
        def fetch_profile(user: str) -> str:
            return f"profile of {user}"

        for i in range(4):
            try:
                print(f"sync call {i + 1}:", fetch_profile("ada"))
            except RateLimited as exc:
                print(f"sync call {i + 1}: denied, retry in {exc.retry_after:.1f}s")
        print("another user:", fetch_profile("bob"))  # separate bucket

        with limit(limiter, "tokens", "user:ada", cost=60) as decision:
            print(f"spent 60 tokens, {decision.remaining} left")
        try:
            with limit(limiter, "tokens", "user:ada", cost=60):
                print("never printed")
        except RateLimited as exc:
            print("60 more tokens: denied by", exc.decision.rule)


async def async_part(url: str) -> None:
    async with AsyncLimiter.from_url(url, region="local", rules=RULES) as limiter:

        @limited(limiter, "calls", subject="nightly-report", on_denied="return")
        async def report() -> str:
            return "report sent"

        print("async calls:", [await report() for _ in range(4)])  # the 4th returns None

        async with alimit(limiter, "tokens", "user:grace", cost=30) as decision:
            print(f"async spent 30 tokens, {decision.remaining} left")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="default: start an embedded redis-server")
    args = parser.parse_args()
    if args.redis_url:
        sync_part(args.redis_url)
        asyncio.run(async_part(args.redis_url))
        return
    with EmbeddedRedis() as server:
        sync_part(server.url)
        asyncio.run(async_part(server.url))


if __name__ == "__main__":
    main()

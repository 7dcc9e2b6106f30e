"""FastAPI with the geolimit ASGI middleware.

    python examples/fastapi_app.py                                   # embedded redis-server
    python examples/fastapi_app.py --redis-url redis://127.0.0.1:6379/0 --port 8000

    GET /api/hello      3 requests per 10 s per client IP
    GET /partner/data   5 requests per 10 s per X-API-Key header
    GET /health         not limited

Try `curl -i localhost:8000/api/hello` four times: the fourth is a 429 with
Retry-After, RateLimit and RateLimit-Policy headers and a problem+json body.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request

from geolimit import AsyncLimiter, Rule
from geolimit.middleware import GeolimitMiddleware, policy
from geolimit.store.embedded import EmbeddedRedis

RULES = [Rule("api", limit=3, window=10), Rule("partner", limit=5, window=10)]


def build_app(redis_url: str, trusted_proxies: list[str]) -> FastAPI:
    limiter = AsyncLimiter.from_url(redis_url, region="local", rules=RULES)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await limiter.aclose()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(
        GeolimitMiddleware,
        limiter_or_decider=limiter,
        routes=[policy("/api/*", "api", key="ip"), policy("/partner/*", "partner", key="header:X-API-Key")],
        trusted_proxies=trusted_proxies,
    )

    @app.get("/api/hello")
    async def hello(request: Request) -> dict[str, object]:
        decision = request.state.geolimit.decision  # what the middleware decided (None: Redis down)
        return {"hello": "world", "remaining": decision.remaining if decision else None}

    @app.get("/partner/data")
    async def partner_data() -> dict[str, object]:
        return {"data": [1, 2, 3]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="default: start an embedded redis-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--trusted-proxy", action="append", default=[], help="address or CIDR")
    args = parser.parse_args()
    # proxy_headers=False: geolimit reads X-Forwarded-For itself, from --trusted-proxy peers only.
    if args.redis_url:
        app = build_app(args.redis_url, args.trusted_proxy)
        uvicorn.run(app, host=args.host, port=args.port, proxy_headers=False)
        return
    with EmbeddedRedis() as server:
        app = build_app(server.url, args.trusted_proxy)
        uvicorn.run(app, host=args.host, port=args.port, proxy_headers=False)


if __name__ == "__main__":
    main()

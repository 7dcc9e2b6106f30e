"""Plain Starlette with the geolimit ASGI middleware (works for any ASGI app).

    python examples/starlette_app.py [--redis-url URL] [--port 8001]

    GET /api/hello   3 requests per 10 s per client IP (legacy X-RateLimit-* headers too)
    GET /health      not limited
    WS  /ws          echo; WebSockets and lifespan events pass through the middleware
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from geolimit import AsyncLimiter, Rule
from geolimit.middleware import GeolimitMiddleware
from geolimit.store.embedded import EmbeddedRedis


def build_app(redis_url: str) -> GeolimitMiddleware:
    limiter = AsyncLimiter.from_url(redis_url, region="local", rules=[Rule("api", limit=3, window=10)])

    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"hello": "world"})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        async for text in websocket.iter_text():
            await websocket.send_text(text)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await limiter.aclose()

    app = Starlette(
        routes=[Route("/api/hello", hello), Route("/health", health), WebSocketRoute("/ws", echo)],
        lifespan=lifespan,
    )
    # One limit on /api/*: rule "api", keyed by client IP.
    return GeolimitMiddleware.simple(app, limiter, rule="api", key="ip", path="/api/*", legacy_headers=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="default: start an embedded redis-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    # proxy_headers=False: no peer may set X-Forwarded-For (see geolimit.middleware.asgi).
    if args.redis_url:
        uvicorn.run(build_app(args.redis_url), host=args.host, port=args.port, proxy_headers=False)
        return
    with EmbeddedRedis() as server:
        uvicorn.run(build_app(server.url), host=args.host, port=args.port, proxy_headers=False)


if __name__ == "__main__":
    main()

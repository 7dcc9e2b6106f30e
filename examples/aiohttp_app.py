"""aiohttp with the geolimit middleware.

    python examples/aiohttp_app.py [--redis-url URL] [--port 8002]

    GET /api/hello    3 requests per 10 s per client IP
    GET /api/stream   the same limit; a streamed response still gets the headers
    POST /upload      1 MiB of request body per 10 s per X-API-Key (cost = Content-Length)
    GET /health       not limited
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

from aiohttp import web

from geolimit import AsyncLimiter, Rule
from geolimit.middleware import policy, setup_geolimit
from geolimit.store.embedded import EmbeddedRedis


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": "world"})


async def stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)  # headers go out here: the prepare hook adds ours
    for i in range(3):
        await response.write(f"chunk {i}\n".encode())
    await response.write_eof()
    return response


async def upload(request: web.Request) -> web.Response:
    return web.json_response({"received": len(await request.read())})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(redis_url: str) -> web.Application:
    rules = [Rule("api", limit=3, window=10), Rule("upload-bytes", limit=1 << 20, window=10)]
    limiter = AsyncLimiter.from_url(redis_url, region="local", rules=rules)

    async def close_limiter(app: web.Application) -> AsyncIterator[None]:
        yield
        await limiter.aclose()

    app = web.Application()
    setup_geolimit(app, limiter, [
        policy("/api/*", "api", key="ip"),
        policy("/upload", "upload-bytes", key="header:X-API-Key", cost="body"),
    ])
    app.cleanup_ctx.append(close_limiter)
    app.add_routes([
        web.get("/api/hello", hello), web.get("/api/stream", stream),
        web.post("/upload", upload), web.get("/health", health),
    ])
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="default: start an embedded redis-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args()
    if args.redis_url:
        web.run_app(build_app(args.redis_url), host=args.host, port=args.port)
        return
    with EmbeddedRedis() as server:
        web.run_app(build_app(server.url), host=args.host, port=args.port)


if __name__ == "__main__":
    main()

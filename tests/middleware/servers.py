"""Real HTTP servers on 127.0.0.1 ephemeral ports, and header parsing, for the middleware tests.

* :func:`uvicorn_serving` runs an ASGI app under uvicorn in a background thread
  (its own event loop) and yields the base URL once the socket is listening.
* :func:`aiohttp_serving` runs an aiohttp app with ``web.AppRunner`` in the
  test's event loop.
* :func:`wait_until_ready` polls a subprocess server until it answers.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

import http_sfv
import httpx
import uvicorn
from aiohttp import web

from geolimit.middleware.asgi import ASGIApp

DEADLINE = 15.0


def prefix() -> str:
    """A fresh key prefix, so tests never share counters."""
    return "t" + secrets.token_hex(4)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


free_port = closed_port  # for subprocess servers: the same trick, then they bind it


@contextmanager
def uvicorn_serving(
    app: ASGIApp,
    *,
    lifespan: Literal["auto", "on", "off"] = "auto",
    on_exit: Callable[[], Awaitable[None]] | None = None,
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread; ``on_exit`` runs in the server's loop after it stops."""
    # proxy_headers=False: uvicorn would otherwise rewrite scope["client"] from X-Forwarded-For
    # (it trusts 127.0.0.1 by default), and the middleware's own trusted-proxy logic is under test.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan, proxy_headers=False
    )
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    async def run() -> None:
        try:
            await server.serve()
        finally:
            if on_exit is not None:
                await on_exit()

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported to the test thread
            failure.append(exc)

    thread = threading.Thread(target=target, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn stopped before listening: {failure}")
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start listening in time")
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE)
        assert not thread.is_alive(), "uvicorn did not stop"
        assert not failure, failure


@asynccontextmanager
async def aiohttp_serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def wait_until_ready(
    process: subprocess.Popen[str], url: str, output: Callable[[], str] = str, deadline: float = DEADLINE
) -> None:
    """Poll ``url`` until it answers 200; fail early (with ``output()``) if the process exits."""
    end = time.monotonic() + deadline
    last: Exception | None = None
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{output()}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.02)
    raise TimeoutError(f"{url} not ready after {deadline} s: {last!r}\n{output()}")


def sf_list(value: str) -> list[tuple[Any, dict[str, Any]]]:
    """A Structured Field List header as ``[(item, params), ...]``."""
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    return [(item.value, dict(item.params)) for item in parsed]


def check_allowed(headers: Mapping[str, str], rule: str, limit: int, window: int, remaining: int) -> None:
    """An allowed response's RateLimit-Policy and RateLimit headers."""
    assert sf_list(headers["RateLimit-Policy"]) == [(rule, {"q": limit, "w": window})]
    [(name, params)] = sf_list(headers["RateLimit"])
    assert name == rule
    assert params["r"] == remaining
    assert 0 <= params["t"] <= window + 1, "seconds during which no more than r is available"
    assert "Retry-After" not in headers


def check_denied(status: int, headers: Mapping[str, str], body: Mapping[str, Any], rule: str, limit: int,
                 window: int, path: str) -> None:
    """A 429's headers and problem+json body."""
    assert status == 429
    assert headers["Content-Type"] == "application/problem+json"
    assert 1 <= int(headers["Retry-After"]) <= window + 1
    assert sf_list(headers["RateLimit-Policy"]) == [(rule, {"q": limit, "w": window})]
    [(name, params)] = sf_list(headers["RateLimit"])
    assert (name, params["r"]) == (rule, 0)
    assert params["t"] <= int(headers["Retry-After"]), "Retry-After never ends before the effective window"
    assert body["status"] == 429
    assert body["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert body["violated-policies"] == [rule]
    assert body["rule"] == rule
    assert body["limit"] == limit
    assert body["instance"] == path
    assert 0 < body["retry_after"] <= window + 1

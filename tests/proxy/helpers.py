"""A real upstream aiohttp app, proxy config files and a proxy subprocess for the proxy tests."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from geolimit.proxy import Proxy
from tests.server.helpers import dump_toml
from tests.support.cli_process import CliProcess

T = TypeVar("T")

__all__ = ["ProxyProcess", "StartProxy", "Upstream", "body_chunks", "dump_toml", "proxy_config", "rss_bytes"]

MIB = 1024 * 1024
StartProxy = Callable[[Mapping[str, Any]], Awaitable[Proxy]]


@dataclass
class Seen:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: int

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else None


class Upstream:
    """An aiohttp app on loopback that records what it receives.

    ``/echo`` streams the request body back; ``/download/N`` streams N bytes;
    ``/upload`` answers the body's length and SHA-256; ``/slow`` waits for
    ``release``; ``/hang`` never answers; ``/broken`` promises 1 MiB and stops
    after a few bytes; ``/gzip`` answers a gzip-encoded body; ``/status/N``
    answers status N; any other path answers what was received as JSON.
    """

    def __init__(self, name: str = "up") -> None:
        self.name = name
        self.seen: list[Seen] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> Upstream:
        app = web.Application(client_max_size=16 * MIB)
        app.router.add_route("*", "/echo", self._echo)
        app.router.add_get("/download/{size}", self._download)
        app.router.add_post("/upload", self._upload)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/hang", self._hang)
        app.router.add_get("/broken", self._broken)
        app.router.add_get("/gzip", self._gzip)
        app.router.add_route("*", "/status/{code}", self._status)
        app.router.add_route("*", "/{tail:.*}", self._info)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        host, bound = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _record(self, request: web.Request, body: int = 0) -> Seen:
        seen = Seen(request.method, request.raw_path, list(request.headers.items()), body)
        self.seen.append(seen)
        return seen

    async def _info(self, request: web.Request) -> web.Response:
        body = await request.read()
        seen = self._record(request, len(body))
        return web.json_response({"upstream": self.name, "method": seen.method, "target": seen.target,
                                  "headers": seen.headers, "body": len(body)},
                                 headers={"X-Upstream": self.name})

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        resp = web.StreamResponse()
        if request.content_length is not None:
            resp.content_length = request.content_length
        await resp.prepare(request)
        while chunk := await request.content.readany():
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def _download(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        size = int(request.match_info["size"])
        resp = web.StreamResponse()
        resp.content_length = size
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        for offset in range(0, size, MIB):
            await resp.write(_CHUNK[: min(MIB, size - offset)])
        await resp.write_eof()
        return resp

    async def _upload(self, request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            digest.update(chunk)
        self._record(request, size)
        return web.json_response({"size": size, "sha256": digest.hexdigest(),
                                  "content_length": request.headers.get("Content-Length"),
                                  "transfer_encoding": request.headers.get("Transfer-Encoding")})

    async def _slow(self, request: web.Request) -> web.Response:
        self._record(request)
        self.entered.set()
        await self.release.wait()
        return web.Response(text="finally")

    async def _hang(self, request: web.Request) -> web.Response:
        self._record(request)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def _broken(self, request: web.Request) -> web.StreamResponse:
        self._record(request)
        resp = web.StreamResponse()
        resp.content_length = MIB
        await resp.prepare(request)
        await resp.write(b"x" * 100_000)
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def _gzip(self, request: web.Request) -> web.Response:
        self._record(request)
        # mtime=0: the same bytes every time (gzip's header holds the second it was made, so two
        # answers a second boundary apart differed, and tests comparing what proxies passed on failed)
        return web.Response(body=gzip.compress(b"hello " * 100, mtime=0), headers={"Content-Encoding": "gzip"})

    async def _status(self, request: web.Request) -> web.Response:
        self._record(request)
        code = int(request.match_info["code"])
        headers = {"Keep-Alive": "timeout=5", "X-Hop": "secret", "Connection": "X-Hop", "X-End": "kept"}
        if code in (204, 304):
            return web.Response(status=code, headers=headers)
        resp = web.Response(status=code, text="status body", headers=headers)
        resp.headers.add("Set-Cookie", "a=1; Path=/")
        resp.headers.add("Set-Cookie", "b=2; Path=/")
        return resp


_CHUNK = bytes(range(256)) * (MIB // 256)


async def body_chunks(total: int, chunk: int = MIB) -> AsyncIterator[bytes]:
    """``total`` bytes of the repeating pattern (the same buffer, so the sender uses no memory)."""
    for offset in range(0, total, chunk):
        yield _CHUNK[: min(chunk, total - offset)]


def expected_sha256(total: int) -> str:
    digest = hashlib.sha256()
    for offset in range(0, total, MIB):
        digest.update(_CHUNK[: min(MIB, total - offset)])
    return digest.hexdigest()


def proxy_config(
    upstreams: list[str],
    *,
    redis_url: str | None = None,
    agent_url: str | None = None,
    rules: Sequence[Mapping[str, Any]] | None = None,
    routes: Sequence[Mapping[str, Any]] | None = None,
    region: str = "a",
    **proxy: Any,
) -> dict[str, Any]:
    """A proxy config as a dict (``dump_toml`` it or ``parse_proxy_config`` it)."""
    table: dict[str, Any] = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "upstreams": upstreams}
    if redis_url is not None:
        table |= {"redis_url": redis_url, "region": region}
    if agent_url is not None:
        table["agent_url"] = agent_url
    table |= proxy
    data: dict[str, Any] = {"proxy": table}
    if rules is not None:
        data["rule"] = [dict(r) for r in rules]
    if routes is not None:
        data["route"] = [dict(r) for r in routes]
    data["log"] = {"level": "DEBUG"}
    return data


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS in /proc/PID/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def peak_rss_during(pid: int, work: Awaitable[T]) -> tuple[T, int]:
    """``work``'s result and the highest resident set size of ``pid``, sampled every 10 ms while it ran."""
    peak = rss_bytes(pid)
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.01)

    sampler = asyncio.ensure_future(sample())
    try:
        result = await work
    finally:
        done.set()
        await sampler
    return result, peak


class ProxyProcess(CliProcess):
    """``python -m geolimit.cli proxy --config ...`` with its stderr collected line by line."""

    command = "proxy"

    async def urls(self) -> tuple[str, str]:
        """The proxy's and its admin listener's URLs, from the 'listening on' log line."""
        found = await self.wait_for_log(r"listening on (http://[0-9.]+:\d+) \(admin: (http://[0-9.]+:\d+)")
        return found.group(1), found.group(2)


async def get_json(session: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, Any]:
    async with session.get(url, **kwargs) as resp:
        return resp.status, json.loads(await resp.read())


async def metric_lines(session: aiohttp.ClientSession, admin_url: str, prefix: str) -> dict[str, float]:
    """The proxy's /metrics samples whose lines start with ``prefix``: {name and labels: value}."""
    async with session.get(admin_url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}

"""Real upstream servers on 127.0.0.1 for the FaultyLink tests (each started and stopped per test)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@dataclass
class HttpEcho:
    """aiohttp server: ``POST /echo`` answers the body; every body received is recorded."""

    port: int = 0
    received: list[bytes] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def http_echo() -> AsyncIterator[HttpEcho]:
    echo = HttpEcho()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        echo.received.append(body)
        return web.Response(body=body, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_post("/echo", handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    echo.port = int(runner.addresses[0][1])
    try:
        yield echo
    finally:
        await runner.cleanup()


@dataclass
class TcpServer:
    """A raw asyncio server; ``accepted`` gets the server side of every connection."""

    port: int = 0
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(
        default_factory=asyncio.Queue
    )
    received: int = 0  # bytes read by the echo handler
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


async def _serve(echo: bool) -> AsyncIterator[TcpServer]:
    state = TcpServer()
    handlers: set[asyncio.Task[object]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        state.writers.append(writer)
        try:
            if not echo:
                state.accepted.put_nowait((reader, writer))
                return  # the test drives this connection
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    state.received += len(data)
                    writer.write(data)
                    await writer.drain()
                writer.close()
        finally:
            handlers.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.port = int(server.sockets[0].getsockname()[1])
    try:
        yield state
    finally:
        server.close()
        for writer in state.writers:
            writer.transport.abort()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*list(handlers), return_exceptions=True)
        await server.wait_closed()


@pytest.fixture
async def tcp_echo() -> AsyncIterator[TcpServer]:
    """Echoes every byte back, in order."""
    async for state in _serve(echo=True):
        yield state


@pytest.fixture
async def tcp_sink() -> AsyncIterator[TcpServer]:
    """Hands each accepted connection to the test through ``accepted``."""
    async for state in _serve(echo=False):
        yield state

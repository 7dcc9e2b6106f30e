"""Shared by the malformed-request log tests of the agent (tests/server) and the proxy (tests/proxy)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from geolimit.http.bad_requests import MalformedRequests


@contextmanager
def fresh_malformed_filter() -> Iterator[None]:
    """No summary filter left on aiohttp's logger by an earlier test in this process (its 10 s would
    hold our line back, and the server under test must install its own), before and after."""
    logger = logging.getLogger("aiohttp.server")

    def drop() -> None:
        for f in [f for f in logger.filters if isinstance(f, MalformedRequests)]:
            logger.removeFilter(f)

    drop()
    try:
        yield
    finally:
        drop()


async def send_raw(url: str, data: bytes) -> bytes:
    """``data`` on a new connection to ``http://host:port``; what came back (up to 64 KiB) until it closed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()

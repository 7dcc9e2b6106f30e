"""Fixtures of the proxy tests: a real upstream app and proxies started in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from geolimit.proxy import Proxy, parse_proxy_config
from tests.proxy.helpers import StartProxy, Upstream


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = await Upstream().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    """``await start_proxy(config_dict)``: a started in-process Proxy, stopped at teardown."""
    proxies: list[Proxy] = []

    async def start(data: Mapping[str, Any]) -> Proxy:
        proxy = Proxy(parse_proxy_config(data))
        proxies.append(proxy)
        await proxy.start()
        return proxy

    try:
        yield start
    finally:
        for proxy in proxies:
            await proxy.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=30), cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
    ) as s:
        yield s

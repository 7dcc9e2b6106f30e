"""Listeners: proxy workers sharing one port (SO_REUSEPORT), a taken port, the event loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest

from geolimit.errors import GeolimitError
from geolimit.http.listener import run_event_loop
from geolimit.proxy import Proxy, parse_proxy_config
from geolimit.proxy.config import ProxyConfig
from tests.proxy.helpers import Upstream, proxy_config


def limited_config(upstream: Upstream, redis_url: str) -> ProxyConfig:
    return parse_proxy_config(proxy_config(
        [upstream.url], redis_url=redis_url, rules=[{"name": "listener", "limit": "100000/10s"}],
        routes=[{"path": "/*", "limits": [{"rule": "listener", "key": "ip"}]}],
    ))


@pytest.fixture
async def first(upstream: Upstream, redis_url: str) -> AsyncIterator[Proxy]:
    proxy = Proxy(limited_config(upstream, redis_url), reuse_port=True)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def status_on_new_connection(url: str) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.get(url + "/items") as resp:
        await resp.read()
        return resp.status


async def test_workers_with_reuse_port_share_one_port_and_outlive_each_other(
    first: Proxy, upstream: Upstream, redis_url: str
) -> None:
    port = int(first.url.rsplit(":", 1)[1])
    config = replace(limited_config(upstream, redis_url), listen=("127.0.0.1", port), admin_listen=None)
    second = Proxy(config, reuse_port=True)
    await second.start()
    try:
        assert second.url == first.url
        assert [await status_on_new_connection(first.url) for _ in range(20)] == [200] * 20
        await first.stop()  # one worker goes away: the port stays open and the other answers
        assert [await status_on_new_connection(second.url) for _ in range(5)] == [200] * 5
    finally:
        await second.stop()
    assert len(upstream.seen) == 25


async def test_a_taken_port_is_a_clear_error(first: Proxy, upstream: Upstream, redis_url: str) -> None:
    port = int(first.url.rsplit(":", 1)[1])
    config = replace(limited_config(upstream, redis_url), listen=("127.0.0.1", port), admin_listen=None)
    with pytest.raises(GeolimitError, match=r"proxy: cannot listen: .*in use"):
        await Proxy(config).start()  # without reuse_port: the port is taken
    assert await status_on_new_connection(first.url) == 200


def test_the_event_loop_is_asyncio_s_own_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if the fast extra were not installed

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_module()).startswith("asyncio")


def test_the_event_loop_is_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop", reason="the fast extra (uvloop) is not installed")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_module()).startswith("uvloop")

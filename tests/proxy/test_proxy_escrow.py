"""Two proxies in two regions hold an escrow rule's limit under a burst at both at once."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path

import aiohttp

from geolimit import Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.regions import Regions, eventually


async def test_a_burst_at_two_proxies_admits_at_most_the_escrow_limit(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], upstream: Upstream,
    start_proxy: StartProxy, session: aiohttp.ClientSession,
) -> None:
    token = secrets.token_hex(24)
    (tmp_path / "api.token").write_text(token + "\n")
    rules = [Rule("login", 6, 2, escrow=True)]
    routes = [{"path": "/login", "limits": [{"rule": "login", "key": "header:X-User", "on_error": "deny"}]}]
    async with Regions(redis_server_factory, ["east", "west"], rules, interval=0.05, api_token=token) as rs:
        urls = []
        for name in ("east", "west"):
            data = proxy_config([upstream.url], agent_url=rs[name].agent.url, routes=routes)
            data["proxy"]["agent_token_file"] = str(tmp_path / "api.token")
            urls.append((await start_proxy(data)).url)

        def released() -> bool:  # a fresh Redis holds escrow rules for one window, until restored from peers
            replicators = [rs[n].agent.escrow for n in ("east", "west")]
            return all(r is not None and r.held == 0 for r in replicators)

        await eventually(released, timeout=30, what="escrow rules released after the first window")

        async def attempt(url: str) -> int:
            async with session.get(url + "/login", headers={"X-User": "victim"}) as resp:
                return resp.status

        statuses = await asyncio.gather(*(attempt(url) for url in urls for _ in range(6)))
        assert sorted(statuses) == [200] * 6 + [429] * 6, statuses

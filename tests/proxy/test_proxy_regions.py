"""Two proxies in two regions share one global limit through their regions' agents."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import http_sfv

from geolimit import Rule
from geolimit.store.embedded import EmbeddedRedis
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.support.regions import Regions, eventually


def remaining(header: str) -> int:
    parsed = http_sfv.List()
    parsed.parse(header.encode())
    return int(parsed[0].params["r"])


async def test_two_proxies_in_two_regions_share_one_global_limit(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], upstream: Upstream,
    start_proxy: StartProxy, session: aiohttp.ClientSession,
) -> None:
    token = secrets.token_hex(24)
    (tmp_path / "api.token").write_text(token + "\n")
    # predict=False: no budget is reserved for a peer's recent rate, so the global count is exact.
    rules = [Rule("api", 5, 60, 6, predict=False)]
    routes = [{"path": "/api/*", "limits": [{"rule": "api", "key": "header:X-API-Key", "on_error": "deny"}]}]
    async with Regions(redis_server_factory, ["east", "west"], rules, interval=0.05, api_token=token) as rs:
        proxies = {}
        for name in ("east", "west"):
            data = proxy_config([upstream.url], agent_url=rs[name].agent.url, routes=routes)
            data["proxy"]["agent_token_file"] = str(tmp_path / "api.token")
            proxies[name] = await start_proxy(data)
        east, west = proxies["east"].url, proxies["west"].url
        key = {"X-API-Key": "customer-7"}

        for expected in (4, 3, 2):
            async with session.get(east + "/api/orders", headers=key) as resp:
                assert resp.status == 200
                assert remaining(resp.headers["RateLimit"]) == expected

        def replicated(region: str, total: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                usage = await rs[region].agent.require_limiter().usage("api", "x-api-key=customer-7")
                return usage.total == total
            return check

        await eventually(replicated("west", 3), timeout=10, what="east's hits to reach west")
        statuses = []
        for _ in range(3):
            async with session.get(west + "/api/orders", headers=key) as resp:
                statuses.append(resp.status)
                last = resp
        assert statuses == [200, 200, 429], "west sees east's 3 hits: 5 - 3 = 2 left"
        assert last.headers["Retry-After"].isdigit()
        assert remaining(last.headers["RateLimit"]) == 0
        async with session.get(west + "/api/orders", headers={"X-API-Key": "customer-8"}) as resp:
            assert resp.status == 200, "other keys are unaffected"

        await eventually(replicated("east", 5), timeout=10, what="west's hits to reach east")
        async with session.get(east + "/api/orders", headers=key) as resp:
            assert resp.status == 429, "east now sees the global 5"
        assert len([s for s in upstream.seen if s.target == "/api/orders"]) == 6, "5 global + 1 other key"
        # A route naming a rule the agent does not know refuses the start: tests/proxy/test_proxy_agent_mode.py.

"""Agent mode: the proxy's routes checked against the agent's rules (real agent read from TOML, real Redis,
real upstream): a rule the agent does not decide refuses the start (or a reload), a multi-rate table's
name applies all of its rules, and an agent that is down at start is asked again, never silently allowing."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import http_sfv
import pytest

from geolimit.errors import ConfigError
from geolimit.proxy import Proxy, parse_proxy_config
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, parse_config
from geolimit.store.embedded import EmbeddedRedis
from tests.proxy.helpers import StartProxy, Upstream, proxy_config
from tests.server.helpers import region_config
from tests.support.agent_fixtures import agents
from tests.support.regions import dead_url, eventually

__all__ = ["agents"]  # fixtures

ROUTES = [{"path": "/multi", "limits": [{"rule": "multi", "on_error": "deny"}]},
          {"path": "/api/*", "limits": [{"rule": "api"}]}]


def names(header: str) -> list[tuple[str, int]]:
    parsed = http_sfv.List()
    parsed.parse(header.encode("ascii"))
    return [(str(item.value), int(item.params["r"])) for item in parsed]


@pytest.fixture
def agent_config(tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis]) -> AgentConfig:
    """A region.toml with a plain rule and a multi-rate table, as the agent reads it."""
    (tmp_path / "gossip.key").write_text(secrets.token_hex(32) + "\n")
    data = region_config(redis_server_factory().url, peers=[{"name": "b", "url": dead_url()}], rules=[
        {"name": "api", "limit": "5/60s"}, {"name": "multi", "limit": "4/hour;2/minute"}])
    return parse_config(data, tmp_path / "region.toml")


async def listening(agents: list[Agent], config: AgentConfig, port: int = 0) -> Agent:
    agent = Agent(replace(config, listen=("127.0.0.1", port)))
    agents.append(agent)
    await agent.listen()
    return agent


async def test_a_rule_the_agent_does_not_decide_refuses_the_start_and_a_reload(
    agent_config: AgentConfig, agents: list[Agent], upstream: Upstream, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    agent = await listening(agents, agent_config)
    unknown = [*ROUTES, {"path": "/unknown", "limits": [{"rule": "not-on-the-agent"}]}]
    proxy = Proxy(parse_proxy_config(proxy_config([upstream.url], agent_url=agent.url, routes=unknown)))
    with pytest.raises(ConfigError, match=r"route\[2\] \(path '/unknown'\): rule 'not-on-the-agent' is not one "
                                          r"of the agent's rules \(it has api, multi\.1h, multi\.1m; multi-rate "
                                          r"tables multi \(multi\.1h \+ multi\.1m\)\)"):
        await proxy.start()
    assert not proxy.ready

    running = await start_proxy(proxy_config([upstream.url], agent_url=agent.url, routes=ROUTES))
    with pytest.raises(ConfigError, match=r"rule 'not-on-the-agent'"):
        await running.reload(parse_proxy_config(proxy_config([upstream.url], agent_url=agent.url, routes=unknown)))
    async with session.get(running.url + "/unknown") as resp:
        assert (resp.status, "RateLimit" in resp.headers) == (200, False), "the running routes stayed"
    async with session.get(running.url + "/api/x") as resp:
        assert names(resp.headers["RateLimit"]) == [("api", 4)]


async def test_a_multi_rate_table_applies_all_of_its_rules_all_or_nothing(
    agent_config: AgentConfig, agents: list[Agent], upstream: Upstream, start_proxy: StartProxy,
    session: aiohttp.ClientSession,
) -> None:
    agent = await listening(agents, agent_config)
    proxy = await start_proxy(proxy_config([upstream.url], agent_url=agent.url, routes=ROUTES))
    seen = []
    for _ in range(3):
        async with session.get(proxy.url + "/multi") as resp:
            seen.append((resp.status, names(resp.headers["RateLimit"])))
            last = resp
    assert seen == [(200, [("multi.1h", 3), ("multi.1m", 1)]), (200, [("multi.1h", 2), ("multi.1m", 0)]),
                    (429, [("multi.1h", 2), ("multi.1m", 0)])]
    assert int(last.headers["Retry-After"]) >= 1
    usage = await agent.require_limiter().usage("multi.1h", "ip=127.0.0.1")
    assert usage.total == 2, "the denied request consumed nothing of the hourly rate"


async def test_an_agent_down_at_start_is_asked_again_and_never_silently_allows(
    agent_config: AgentConfig, agents: list[Agent], upstream: Upstream, start_proxy: StartProxy,
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    url = dead_url()
    routes: list[dict[str, Any]] = [*ROUTES, {"path": "/unknown", "limits": [{"rule": "gone", "on_error": "deny"}]},
                                    {"path": "/open", "limits": [{"rule": "gone-too"}]}]
    with caplog.at_level(logging.INFO, logger="geolimit"):
        proxy = await start_proxy(proxy_config([upstream.url], agent_url=url, routes=routes))
        assert "cannot ask the agent for its rules now" in caplog.text
        async with session.get(proxy.url + "/multi") as resp:
            assert resp.status == 503, "the agent is down and the limit fails closed"

        await listening(agents, agent_config, port=int(url.rsplit(":", 1)[1]))
        async with session.get(proxy.url + "/multi") as resp:  # learnt or not: the table's rules, each shown
            assert (resp.status, names(resp.headers["RateLimit"])) == (200, [("multi.1h", 3), ("multi.1m", 1)])
        await eventually(lambda: "route[2] (path '/unknown'): rule 'gone' is not one of the agent's rules"
                         in caplog.text, timeout=15, what="the proxy to ask the agent for its rules again")
        async with session.get(proxy.url + "/multi") as resp:
            assert (resp.status, names(resp.headers["RateLimit"])) == (200, [("multi.1h", 2), ("multi.1m", 0)])
        async with session.get(proxy.url + "/unknown") as resp:
            assert resp.status == 503, "a rule the agent does not decide fails closed, as its on_error says"
        async with session.get(proxy.url + "/open") as resp:
            assert resp.status == 200, "on_error = allow: open, but logged and counted"
        assert ("route[3] (path '/open'): rule 'gone-too' is not one of the agent's rules (it has api, multi.1h, "
                "multi.1m; multi-rate tables multi (multi.1h + multi.1m)); that limit fails open (on_error = "
                "'allow') on every request") in caplog.text
    async with session.get((proxy.admin_url or "") + "/metrics") as resp:
        text = await resp.text()
    assert 'geolimit_proxy_decisions_total{result="error_allow",route="/open",rule="gone-too"} 1.0' in text

"""SIGHUP reloads the rules of a running agent, after validating the new file."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import aiohttp

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess, dump_toml, region_config, write_secret
from tests.support.regions import dead_url, eventually


async def _limit(url: str, rule: str) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s, s.post(
        url + "/v1/peek", data=json.dumps({"rule": rule, "subject": "u"})
    ) as resp:
        return resp.status, (await resp.json()).get("limit")


async def test_sighup_applies_valid_rules_and_keeps_the_old_ones_on_a_bad_file(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    config = tmp_path / "region.toml"
    data = region_config(region_redis.url, peers=[{"name": "b", "url": dead_url()}])
    config.write_text(dump_toml(data))
    agent = await AgentProcess.start(config)
    running.append(agent)
    url = await agent.url()
    assert await _limit(url, "api") == (200, 2)

    data["rule"] = [{"name": "api", "limit": "7/10s", "resolution": 1}, {"name": "new", "limit": "3/1m"}]
    config.write_text(dump_toml(data))
    agent.proc.send_signal(signal.SIGHUP)

    async def applied() -> bool:
        return await _limit(url, "api") == (200, 7) and (await _limit(url, "new"))[0] == 200

    await eventually(applied, timeout=10, what=f"the reloaded rules; log:\n{agent.log}")
    assert "reloaded" in agent.log
    assert "+new" in agent.log
    assert "~api" in agent.log

    config.write_text("[region\nthis is not toml")
    agent.proc.send_signal(signal.SIGHUP)
    await eventually(lambda: "reload of" in agent.log and "refused" in agent.log, timeout=10, what="refusal log")
    assert await _limit(url, "api") == (200, 7), "a bad file keeps the running rules"

    data["rule"] = [{"name": "api", "limit": "7/20s", "resolution": 1}]  # another window: keys would be misread
    config.write_text(dump_toml(data))
    agent.proc.send_signal(signal.SIGHUP)
    await eventually(lambda: agent.log.count("refused") >= 2, timeout=10, what="refusal of a structure change")
    assert "window 20s" in agent.log
    assert await _limit(url, "api") == (200, 7)
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait() == 0


async def test_status_command_prints_peers_lag_and_outbox(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    from tests.server.helpers import cli

    write_secret(tmp_path / "gossip.key")
    config = tmp_path / "region.toml"
    config.write_text(dump_toml(region_config(region_redis.url, peers=[{"name": "b", "url": dead_url()}])))
    agent = await AgentProcess.start(config)
    running.append(agent)
    url = await agent.url()

    async def failing_peer_shown() -> bool:
        out = await cli("status", "--agent", url)
        return "region a" in out.stdout and any(
            line.startswith("b ") and "never" in line and "unreachable" in line for line in out.stdout.splitlines()
        )

    await eventually(failing_peer_shown, timeout=15, what="b listed as failing")
    out = await cli("status", "--agent", url, "--json")
    assert json.loads(out.stdout)["peers"]["b"]["consecutive_failures"] > 0
    gone = await cli("status", "--agent", dead_url())
    assert gone.code == 3

"""`geolimit agent` and `geolimit check` as real processes against a real Redis."""

from __future__ import annotations

import json
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess, cli, dump_toml, region_config, write_secret
from tests.support.regions import dead_url, eventually


def write_config(tmp_path: Path, redis_url: str, **changes: Any) -> Path:
    data = region_config(redis_url, peers=[{"name": "b", "url": dead_url()}])
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "region.toml"
    path.write_text(dump_toml(data))
    return path


async def start(running: list[AgentProcess], config: Path) -> tuple[AgentProcess, str]:
    agent = await AgentProcess.start(config, "--flush-timeout", "1")
    running.append(agent)
    url = await agent.url()

    async def ready() -> bool:
        async with aiohttp.ClientSession() as s:
            try:
                async with s.get(url + "/readyz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

    await eventually(ready, timeout=20, what=f"/readyz of the agent; log:\n{agent.log}")
    return agent, url


async def test_agent_serves_check_and_stops_gracefully_on_sigterm(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    agent, url = await start(running, write_config(tmp_path, region_redis.url))

    results = [await cli("check", "--agent", url, "api", "user:42") for _ in range(3)]
    assert [r.code for r in results] == [0, 0, 1], [r.stderr for r in results]
    assert results[0].stdout.startswith("allowed  limit=2 remaining=1 retry_after=0.000s")
    assert results[2].stdout.startswith("denied  limit=2 remaining=0 retry_after=")
    peek = await cli("check", "--agent", url, "--peek", "--json", "api", "user:43")
    assert peek.code == 0
    assert json.loads(peek.stdout)["remaining"] == 2
    multi = await cli("check", "--agent", url, "--cost", "3", "api", "user:44")
    assert (multi.code, multi.stdout.split()[0]) == (1, "denied")
    assert "retry_after=never" in multi.stdout, "a cost above the limit can never pass"

    unknown = await cli("check", "--agent", url, "nope", "user:42")
    assert unknown.code == 2
    assert unknown.stderr.startswith("geolimit: error: agent answered HTTP 404")
    assert "unknown rule 'nope'" in unknown.stderr
    bad = await cli("check", "--agent", url, "--cost", "-1", "api", "user:42")  # refused before it is sent
    assert (bad.code, "--cost" in bad.stderr) == (2, True)

    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait(timeout=20) == 0
    assert "stopping (flushing outboxes" in agent.log
    assert "agent a: stopped" in agent.log
    gone = await cli("check", "--agent", url, "api", "user:42")
    assert gone.code == 3
    assert "unreachable" in gone.stderr


async def test_sigterm_delivers_pending_cells_before_exiting(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess]
) -> None:
    """Region a's hit reaches b even though a is stopped right after it: the flush on SIGTERM."""
    secret = secrets.token_hex(32).encode()
    servers = {name: redis_server_factory() for name in "ab"}
    urls: dict[str, str] = {}
    agents: dict[str, AgentProcess] = {}
    try:
        for name, other in (("b", "a"), ("a", "b")):  # b first, so a knows b's address
            folder = tmp_path / name
            folder.mkdir()
            write_secret(folder / "gossip.key", secret)
            peer_url = urls.get(other, dead_url())
            data = region_config(servers[name].url, name=name, peers=[{"name": other, "url": peer_url}],
                                 interval="1h")  # no periodic rounds: only the final flush can deliver
            (folder / "region.toml").write_text(dump_toml(data))
            agents[name], urls[name] = await start(running, folder / "region.toml")
        assert (await cli("check", "--agent", urls["a"], "--cost", "2", "api", "user:42")).code == 0
        agents["a"].proc.send_signal(signal.SIGTERM)
        assert await agents["a"].wait(timeout=20) == 0
        assert "changes not delivered yet" not in agents["a"].log
        denied = await cli("check", "--agent", urls["b"], "api", "user:42")
        assert denied.code == 1, "b counts a's 2 hits: the limit of 2 is used up"
        agents["b"].proc.send_signal(signal.SIGTERM)
        assert await agents["b"].wait(timeout=20) == 0
    finally:
        for server in servers.values():
            server.stop()


async def test_api_token_file_is_required_by_the_agent_and_sent_by_check(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    (tmp_path / "api.token").write_text(secrets.token_urlsafe(24) + "\n")
    config = write_config(tmp_path, region_redis.url, region={"api_token_file": "api.token"})
    agent, url = await start(running, config)
    without = await cli("check", "--agent", url, "api", "user:42")
    assert without.code == 2
    assert "401" in without.stderr
    assert "--token-file" in without.stderr
    wrong_file = tmp_path / "wrong.token"
    wrong_file.write_text("not-the-token-at-all")
    assert (await cli("check", "--agent", url, "--token-file", str(wrong_file), "api", "user:42")).code == 2
    missing = await cli("check", "--agent", url, "--token-file", str(tmp_path / "nope"), "api", "user:42")
    assert missing.code == 2
    assert str(tmp_path / "nope") in missing.stderr
    ok = await cli("check", "--agent", url, "--token-file", str(tmp_path / "api.token"), "api", "user:42")
    assert (ok.code, ok.stdout.split()[0]) == (0, "allowed")
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait(timeout=20) == 0


async def test_agent_refuses_to_start_without_its_secret_file(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    agent = await AgentProcess.start(write_config(tmp_path, region_redis.url))
    running.append(agent)
    assert await agent.wait(timeout=30) != 0
    assert str(tmp_path / "gossip.key") in agent.log
    assert "region.secret_file" in agent.log
    assert str(tmp_path / "region.toml") in agent.log


async def test_json_log_format_writes_one_json_object_per_line(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    config = write_config(tmp_path, region_redis.url, log={"format": "json", "level": "info"})
    agent, _ = await start(running, config)
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait(timeout=20) == 0
    entries = [json.loads(line) for line in agent.lines if line.strip()]
    assert entries, "the agent logged nothing"
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    messages = [e["message"] for e in entries]
    assert any("listening on http://127.0.0.1:" in m for m in messages)
    assert any(m.startswith("agent a: stopped") for m in messages)
    assert any(e["level"] == "warning" and "gossip to b failed" in e["message"] for e in entries)

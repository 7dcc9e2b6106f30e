"""`geolimit status` against a real agent: hints on the gossip port and on a 401, whole last errors."""

from __future__ import annotations

import json
import secrets
import signal
import socket
from pathlib import Path

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess, cli, dump_toml, region_config, write_secret
from tests.support.regions import dead_url, eventually


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_status_hints_at_api_listen_and_token_file_and_shows_whole_errors(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    token = secrets.token_urlsafe(24)
    (tmp_path / "api.token").write_text(token + "\n")
    api_port = _free_port()
    data = region_config(region_redis.url, peers=[{"name": "b", "url": dead_url()}])
    data["region"].update({"api_listen": f"127.0.0.1:{api_port}", "api_token_file": "api.token"})
    (tmp_path / "region.toml").write_text(dump_toml(data))
    agent = await AgentProcess.start(tmp_path / "region.toml", "--flush-timeout", "1")
    running.append(agent)
    gossip_url, api_url = await agent.url(), f"http://127.0.0.1:{api_port}"

    on_gossip = await cli("status", "--agent", gossip_url)
    assert on_gossip.code == 2
    assert on_gossip.stderr.startswith("geolimit: error: ")
    assert "404" in on_gossip.stderr
    assert "api_listen" in on_gossip.stderr

    async def answers_401() -> bool:
        ran = await cli("status", "--agent", api_url)
        return "401" in ran.stderr

    await eventually(answers_401, timeout=20, what=f"the API port answering; log:\n{agent.log}")
    without = await cli("status", "--agent", api_url)
    assert without.code == 2
    assert "--token-file" in without.stderr

    (tmp_path / "wrong.token").write_text("not-the-token")
    wrong = await cli("status", "--agent", api_url, "--token-file", str(tmp_path / "wrong.token"))
    assert wrong.code == 2
    assert "does not match" in wrong.stderr

    token_file = str(tmp_path / "api.token")

    async def whole_error_shown() -> bool:
        raw = await cli("status", "--agent", api_url, "--token-file", token_file, "--json")
        error = json.loads(raw.stdout)["peers"]["b"]["last_error"]
        shown = await cli("status", "--agent", api_url, "--token-file", token_file)
        rows = [line for line in shown.stdout.splitlines() if line.startswith("b ")]
        return bool(error) and len(error) > 60 and bool(rows) and rows[0].endswith(error)

    await eventually(whole_error_shown, timeout=20, what="peer b's last error shown whole (> 60 characters)")
    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait(timeout=20) == 0


async def test_status_of_a_json_service_that_is_not_an_agent_is_a_one_line_error() -> None:
    """Once, any JSON with a "region" (another service, another version) ended in a traceback."""
    from aiohttp import web

    answers = [{"region": "x", "peers": [1, 2]}, {"region": "x", "peers": {"a": 5}},
               {"region": "x", "worker": 7}, {"region": "x", "waiting_for": 5}]
    served = iter(answers)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(next(served))

    app = web.Application()
    app.router.add_get("/v1/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for _ in answers:
            ran = await cli("status", "--agent", f"http://127.0.0.1:{port}")
            assert ran.code == 3, ran
            assert ran.stderr.count("\n") == 1, ran.stderr
            assert ran.stderr.startswith(f"geolimit: error: agent http://127.0.0.1:{port}"), ran.stderr
            assert "sent an unexpected status" in ran.stderr, ran.stderr
    finally:
        await runner.cleanup()


async def test_warnings_are_shown_and_json_exits_1_when_not_ready() -> None:
    """The table printed none of /v1/status's warnings (a peer refusing our secret showed only
    as its last error), and --json exited 0 even when the agent was not ready."""
    from aiohttp import web

    answers = {
        "ready": {"region": "a", "ready": True, "peers": {}, "warnings": [
            "peer b refuses this region's signature (3 refusals): check [region] secret_file"]},
        "not ready": {"region": "a", "ready": False, "waiting_for": ["redis"], "peers": {}, "warnings": []},
    }
    current = ["ready"]

    async def status(request: web.Request) -> web.Response:
        return web.json_response(answers[current[0]])

    app = web.Application()
    app.router.add_get("/v1/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        table = await cli("status", "--agent", url)
        assert table.code == 0
        assert "WARNING: peer b refuses this region's signature (3 refusals): check [region] secret_file" in table.stdout
        assert (await cli("status", "--agent", url, "--json")).code == 0
        current[0] = "not ready"
        assert (await cli("status", "--agent", url)).code == 1
        raw = await cli("status", "--agent", url, "--json")
        assert raw.code == 1
        assert json.loads(raw.stdout)["ready"] is False
    finally:
        await runner.cleanup()

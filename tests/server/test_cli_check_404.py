"""`geolimit check` answered 404 by a real agent: an unknown rule, or the gossip port.

Once, the 404 of an unknown rule came with the hint "(is this the gossip port? ...)", although
the API had answered, and its "known rules" left out the base name of a multi-rate table
(``multi``), which the API accepts too.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess, cli, dump_toml, region_config, write_secret
from tests.support.regions import eventually

RULES = [{"name": "api", "limit": "5/minute"}, {"name": "multi", "limit": "10/hour;5/minute"}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_unknown_rule_lists_table_names_without_the_gossip_port_hint(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    write_secret(tmp_path / "gossip.key")
    api_port = _free_port()
    data = region_config(region_redis.url, rules=RULES)
    data["region"]["api_listen"] = f"127.0.0.1:{api_port}"
    (tmp_path / "region.toml").write_text(dump_toml(data))
    agent = await AgentProcess.start(tmp_path / "region.toml", "--flush-timeout", "1")
    running.append(agent)
    gossip_url, api_url = await agent.url(), f"http://127.0.0.1:{api_port}"

    async def api_answers() -> bool:
        return (await cli("check", "--agent", api_url, "multi", "user:1")).code == 0

    await eventually(api_answers, timeout=20, what=f"the API port answering; log:\n{agent.log}")

    unknown = await cli("check", "--agent", api_url, "nope", "user:1")
    assert (unknown.code, unknown.stdout) == (2, ""), unknown
    assert unknown.stderr == (
        'geolimit: error: agent answered HTTP 404: {"error": "unknown rule \'nope\'; known rules: '
        'api, multi (multi.1h, multi.1m)", "field": "rule"}\n'
    ), unknown.stderr

    on_gossip = await cli("check", "--agent", gossip_url, "api", "user:1")
    assert on_gossip.code == 2, on_gossip
    assert on_gossip.stderr.count("\n") == 1, on_gossip.stderr
    assert on_gossip.stderr.startswith("geolimit: error: agent answered HTTP 404: "), on_gossip.stderr
    assert "(is this the gossip port? When [region] api_listen is set" in on_gossip.stderr, on_gossip.stderr

    agent.proc.send_signal(signal.SIGTERM)
    assert await agent.wait(timeout=20) == 0

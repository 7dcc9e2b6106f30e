"""Gossip over TLS: two real agents configured from TOML with [gossip.tls] and https:// peers."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from geolimit.server.agent import Agent
from geolimit.server.config import load_config
from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import Cert, call, dump_toml, make_cert, region_config, write_secret
from tests.support.regions import eventually

U = {"rule": "api", "subject": "user:42"}


def tls_config(folder: Path, redis_url: str, name: str, other: str, cert: Cert, secret: bytes) -> Path:
    folder.mkdir()
    write_secret(folder / "gossip.key", secret)
    # The peer's port is known only once it listens: set_peer_url() fills it in below.
    data = region_config(redis_url, name=name, peers=[{"name": other, "url": "https://127.0.0.1:1"}],
                         rules=[{"name": "api", "limit": "5/10s", "resolution": 1, "predict": False}])  # exact counts
    data["gossip"]["tls"] = {"cert_file": str(cert.cert), "key_file": str(cert.key), "ca_file": str(cert.cert)}
    path = folder / "region.toml"
    path.write_text(dump_toml(data))
    return path


@asynccontextmanager
async def two_regions(
    tmp_path: Path, factory: Callable[..., EmbeddedRedis], cert: Cert, ca_of_a: Path | None = None
) -> AsyncIterator[dict[str, Agent]]:
    """Agents a and b, each on its own Redis, gossiping over TLS with ``cert``."""
    secret = secrets.token_hex(32).encode()
    servers = {name: factory() for name in "ab"}
    agents: dict[str, Agent] = {}
    try:
        for name, other in (("a", "b"), ("b", "a")):
            path = tls_config(tmp_path / name, servers[name].url, name, other, cert, secret)
            if name == "a" and ca_of_a is not None:
                path.write_text(path.read_text().replace(f'ca_file = "{cert.cert}"', f'ca_file = "{ca_of_a}"'))
            agents[name] = Agent(load_config(path))
            await agents[name].listen()
        for name, other in (("a", "b"), ("b", "a")):
            assert agents[other].url.startswith("https://127.0.0.1:")
            agents[name].set_peer_url(other, agents[other].url)
            await agents[name].start()
        yield agents
    finally:
        for agent in agents.values():
            await agent.abort()
        for server in servers.values():
            server.stop()


async def test_a_hit_in_one_region_reaches_the_other_over_tls(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis]
) -> None:
    cert = make_cert(tmp_path)
    async with two_regions(tmp_path, redis_server_factory, cert) as agents, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=cert.client_context())
    ) as session:
        status, d = await call(session, "POST", agents["a"].url + "/v1/check", U | {"cost": 2})
        assert (status, d["allowed"]) == (200, True)

        async def b_sees_it() -> bool:
            _, usage = await call(session, "GET", agents["b"].url + "/v1/usage", params=U)
            return bool(usage["regions"] == {"a": 2})

        await eventually(b_sees_it, what="a's hit at b over TLS")
        status, d = await call(session, "POST", agents["b"].url + "/v1/check", U | {"cost": 4})
        assert (status, d["allowed"], d["remaining"]) == (200, False, 3)
        _, status_b = await call(session, "GET", agents["b"].url + "/v1/status")
        assert status_b["peers"]["a"]["last_contact"] is not None
        assert status_b["peers"]["a"]["errors"] == 0

        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):  # the gossip port speaks TLS only
                await plain.post(agents["a"].url.replace("https://", "http://") + "/v1/gossip", data=b"x")
            with pytest.raises(aiohttp.ClientConnectorCertificateError):  # with a self-signed certificate
                await plain.get(agents["a"].url + "/healthz")


async def test_a_peer_whose_certificate_is_not_trusted_gets_nothing(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis]
) -> None:
    """a trusts another CA than the one that signed b's certificate: a refuses to send to b."""
    (tmp_path / "elsewhere").mkdir()
    cert, other_ca = make_cert(tmp_path), make_cert(tmp_path / "elsewhere")
    async with two_regions(tmp_path, redis_server_factory, cert, ca_of_a=other_ca.cert) as agents:

        def a_refused_b() -> bool:
            peer = agents["a"].status()["peers"]["b"]
            return peer["errors"] >= 1 and "certificate" in (peer["last_error"] or "").lower()

        await eventually(a_refused_b, what="a refusing b's certificate")
        assert agents["a"].status()["peers"]["b"]["last_contact"] is None
        assert agents["a"].status()["peers"]["b"]["anti_entropy_ok"] == 0

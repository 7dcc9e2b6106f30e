"""find_redis_server keeps a symlink's name: Debian's redis-server is a symlink to redis-check-rdb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from geolimit.store.embedded import EmbeddedRedis, find_redis_server

DEBIAN_REDIS_SERVER = Path("/usr/bin/redis-server")


def test_a_symlinked_binary_is_returned_under_its_own_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEOLIMIT_REDIS_SERVER", raising=False)
    target = find_redis_server()
    link = tmp_path / "redis-server"
    link.symlink_to(target)
    monkeypatch.setenv("GEOLIMIT_REDIS_SERVER", str(link))
    assert find_redis_server() == os.path.abspath(link)


def test_debian_redis_server_symlink_starts_a_real_server(monkeypatch: pytest.MonkeyPatch) -> None:
    if not DEBIAN_REDIS_SERVER.is_symlink() and not DEBIAN_REDIS_SERVER.exists():
        pytest.fail(f"{DEBIAN_REDIS_SERVER} is absent: this test needs Debian's redis-server package "
                    "(apt-get install redis-server; .ci/run installs it), or deselect it with "
                    "-k 'not debian_redis_server'")
    monkeypatch.setenv("GEOLIMIT_REDIS_SERVER", str(DEBIAN_REDIS_SERVER))
    assert find_redis_server() == str(DEBIAN_REDIS_SERVER)
    with EmbeddedRedis() as server:
        client = server.client()
        try:
            assert client.ping() is True
            assert client.set("k", "v") is True
            assert client.get("k") == "v"
            assert client.info("server")["executable"].endswith("redis-server")
        finally:
            client.close()

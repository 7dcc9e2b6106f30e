"""Simulation tests: a dedicated redis-server and a summary of the simulated schedules.

The simulator uses databases 0..R-1 of one server and flushes them, so these tests
get a server of their own instead of the shared ``redis_url`` one; on the cluster
fixture it gives each region a key prefix instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from geolimit.store.embedded import EmbeddedRedis
from tests.sim.harness import FAST_ROUNDS, RECORD


@pytest.fixture(scope="session")
def sim_redis(redis_server_factory: Callable[..., EmbeddedRedis]) -> str:
    """Base URL (no DB path) of a redis-server used only by the simulations."""
    return redis_server_factory().url.rsplit("/", 1)[0]


@pytest.fixture(params=["server", pytest.param("cluster", marks=pytest.mark.cluster)])
def sim_store_url(request: pytest.FixtureRequest) -> str:
    """Where simulated regions keep their keys: a database each of ``sim_redis``, or a
    key prefix each on the 3-master Redis Cluster fixture."""
    return str(request.getfixturevalue("sim_redis" if request.param == "server" else "redis_cluster_url"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RECORD:
        return
    rounds = sorted(o.rounds for o in RECORD)

    def total(attr: str) -> float:
        return float(sum(getattr(o, attr) for o in RECORD))

    terminalreporter.section("geolimit: simulated schedules")
    terminalreporter.write_line(
        f"{len(RECORD)} schedules passed, {total('steps'):.0f} steps, {total('hits'):.0f} hits, "
        f"{total('virtual_seconds'):.0f} virtual s, {total('checks'):.0f} safety checks, "
        f"{total('wipes'):.0f} wipes (+{total('wipes_skipped'):.0f} skipped, {total('sync_rounds'):.0f} sync rounds), "
        f"{total('restarts'):.0f} agent restarts"
    )
    terminalreporter.write_line(
        f"rounds to exact convergence after the final heal: median {rounds[len(rounds) // 2]}, "
        f"p99 {rounds[min(len(rounds) - 1, len(rounds) * 99 // 100)]}, max {rounds[-1]}; "
        f"{sum(r > FAST_ROUNDS for r in rounds)} needed more than {FAST_ROUNDS} (a periodic anti-entropy)"
    )

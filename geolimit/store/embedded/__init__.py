"""Real ``redis-server`` processes on loopback: one server, or a small Redis Cluster.

Used by the tests, the demo and the benchmarks to talk to a real Redis without Docker.
Each child runs in its own process group and is stopped, its temporary directory removed,
when the Python process exits: normally (an :mod:`atexit` hook), on SIGTERM or SIGHUP left at
their default disposition, and, on Linux, even on SIGKILL (``PR_SET_PDEATHSIG``; the
directory then stays). See :mod:`geolimit.store.embedded.lifetime`.
"""

from geolimit.store.embedded.cluster import SLOT_COUNT, EmbeddedRedisCluster
from geolimit.store.embedded.server import (
    ENV_SERVER,
    HOW_TO_GET_REDIS,
    EmbeddedRedis,
    find_redis_server,
)

__all__ = [
    "ENV_SERVER",
    "HOW_TO_GET_REDIS",
    "SLOT_COUNT",
    "EmbeddedRedis",
    "EmbeddedRedisCluster",
    "find_redis_server",
]

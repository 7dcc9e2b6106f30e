"""Real ``redis-server`` processes on loopback: one server, or a small Redis Cluster.

Used by the tests, the demo and the benchmarks to talk to a real Redis without Docker.
Each child runs in its own process group, is stopped by an :mod:`atexit` hook and, on
Linux, gets ``PR_SET_PDEATHSIG`` so it dies with the Python process even on SIGKILL.
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

"""A small Redis Cluster (primaries only) made of :class:`EmbeddedRedis` processes."""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from geolimit.errors import ConfigError, StorageError
from geolimit.store.embedded.server import EmbeddedRedis, cmd, find_redis_server, netloc, tail

__all__ = ["SLOT_COUNT", "EmbeddedRedisCluster"]

SLOT_COUNT = 16384


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    bounds = [i * SLOT_COUNT // masters for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class EmbeddedRedisCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas), each an :class:`EmbeddedRedis`.

    :meth:`start` returns only once every node reports ``cluster_state:ok`` and the same,
    complete ``CLUSTER SLOTS`` view, so cluster clients can connect right away.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
    ) -> None:
        if not 1 <= masters <= 64:
            raise ConfigError(f"masters must be between 1 and 64, got {masters}")
        self._masters = masters
        self._host = host
        self._binary = binary
        self._extra_args = tuple(extra_args)
        self._startup_timeout = startup_timeout
        self._nodes: list[EmbeddedRedis] = []

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        return list(self._nodes)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self._nodes]

    @property
    def url(self) -> str:
        if not self._nodes:
            raise StorageError("EmbeddedRedisCluster is not running (url is known after start())")
        return f"redis+cluster://{netloc(self._host, self._nodes[0].port)}"

    def start(self) -> EmbeddedRedisCluster:
        if self._nodes:
            return self
        binary = self._binary or find_redis_server()
        try:
            for _ in range(self._masters):
                node = EmbeddedRedis(
                    host=self._host,
                    binary=binary,
                    cluster_enabled=True,
                    extra_args=self._extra_args,
                )
                self._nodes.append(node)
                node.start()
            self._form_cluster()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        nodes, self._nodes = self._nodes, []
        for node in nodes:
            node.stop()

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _form_cluster(self) -> None:
        clients = [node.client() for node in self._nodes]
        try:
            for epoch, client in enumerate(clients, start=1):  # as redis-cli --cluster does
                cmd(client, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for node in self._nodes[1:]:
                cmd(clients[0], "CLUSTER", "MEET", node.host, node.port)
            for client, (first, last) in zip(clients, _slot_ranges(self._masters), strict=True):
                for start in range(first, last + 1, 2048):  # 6.2 has no ADDSLOTSRANGE
                    cmd(client, "CLUSTER", "ADDSLOTS", *range(start, min(start + 2048, last + 1)))
            deadline = time.monotonic() + self._startup_timeout
            while (problem := self._problem(clients)) is not None:
                if time.monotonic() > deadline:
                    logs = "\n".join(f"--- {n.log_path}\n{tail(n.log_path)}" for n in self._nodes)
                    raise StorageError(
                        f"redis cluster not ready after {self._startup_timeout:g}s: "
                        f"{problem}\n{logs}"
                    )
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _problem(self, clients: list[redis.Redis]) -> str | None:
        """None once every node agrees on a healthy, fully covered cluster; else why not."""
        ranges = _slot_ranges(self._masters)
        expected = sorted(
            (first, last, node.host, node.port)
            for node, (first, last) in zip(self._nodes, ranges, strict=True)
        )
        for node, client in zip(self._nodes, clients, strict=True):
            name = netloc(node.host, node.port)
            lines = str(cmd(client, "CLUSTER", "INFO")).splitlines()
            info = dict(line.strip().split(":", 1) for line in lines if ":" in line)
            if info.get("cluster_state") != "ok":
                return f"{name}: cluster_state={info.get('cluster_state')}"
            if info.get("cluster_known_nodes") != str(self._masters):
                return f"{name}: knows {info.get('cluster_known_nodes')} nodes"
            for line in str(cmd(client, "CLUSTER", "NODES")).splitlines():
                fields = line.split()
                flags = set(fields[2].split(","))
                if flags & {"handshake", "fail", "fail?", "noaddr"} or fields[7] != "connected":
                    return f"{name}: node entry not healthy yet: {line}"
            seen = sorted(
                (int(slot[0]), int(slot[1]), str(slot[2][0]), int(slot[2][1]))
                for slot in cmd(client, "CLUSTER", "SLOTS")
            )
            if seen != expected:
                return f"{name}: CLUSTER SLOTS {seen} != expected {expected}"
        return None

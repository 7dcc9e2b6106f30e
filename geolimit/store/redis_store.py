"""Synchronous Redis stores: the thin I/O shell under :class:`geolimit.Limiter`.

:class:`RedisStore` talks to one Redis server. Script calls take a lean path:
arguments are packed once as RESP bytes and sent on a connection taken from a
lock-free free list, skipping redis-py's generic command pipeline (which costs
more than the script itself). Everything else goes through a normal redis-py
client on the same connection settings.

:class:`ClusterStore` wraps redis-py's :class:`~redis.cluster.RedisCluster`;
every script call carries keys of one hash slot, so redis-py routes it.

redis-py errors never escape: they become :class:`~geolimit.errors.StorageError`.
"""

from __future__ import annotations

from typing import Any, Protocol

import redis
import redis.cluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from geolimit.errors import StorageError
from geolimit.store.protocol import pack_command
from geolimit.store.scripts import LuaScript

__all__ = ["ClusterStore", "RedisStore", "SyncStore", "describe_error"]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class SyncStore(Protocol):
    """What the sync limiter needs from Redis."""

    def run(self, script: LuaScript, args: list[bytes]) -> Any:
        """EVALSHA ``script`` with ``args`` = numkeys, keys..., argv..."""

    def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        """HGETALL of keys that share a hash slot."""

    def client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The redis-py client, for administrative commands."""

    def close(self) -> None: ...


class RedisStore:
    """One Redis server, reached through ``pool``'s connection settings."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._client = redis.Redis(connection_pool=pool)
        self._free: list[Any] = []

    @property
    def pool(self) -> redis.ConnectionPool:
        return self._pool

    def client(self) -> redis.Redis:
        return self._client

    def _make(self) -> Any:
        # Connections on the lean path are owned by the free list, not the pool.
        return self._pool.connection_class(**self._pool.connection_kwargs)

    def _roundtrip(self, packed: bytes) -> Any:
        try:
            conn = self._free.pop()
            reused = True
        except IndexError:
            conn = self._make()
            reused = False
        while True:
            try:
                conn.send_packed_command([packed], check_health=False)
                reply = conn.read_response()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                conn.disconnect()
                if reused and not isinstance(exc, RedisTimeoutError):
                    # A pooled connection may have gone stale (server restart):
                    # try once more on a fresh one.
                    reused = False
                    continue
                raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
            except NoScriptError:
                self._free.append(conn)
                raise
            except RedisError as exc:
                self._free.append(conn)
                raise StorageError(f"Redis error: {describe_error(exc)}") from exc
            except BaseException:
                conn.disconnect()
                raise
            self._free.append(conn)
            return reply

    def run(self, script: LuaScript, args: list[bytes]) -> Any:
        return self.run_resp(script, len(args), b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args))

    def run_resp(self, script: LuaScript, nargs: int, body: bytes) -> Any:
        """EVALSHA with arguments already RESP-encoded in ``body``."""
        packed = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b" % (nargs + 2, script.sha, body)
        try:
            return self._roundtrip(packed)
        except NoScriptError:
            self._roundtrip(pack_command(b"SCRIPT", b"LOAD", script.source))
            try:
                return self._roundtrip(packed)
            except NoScriptError as exc:  # pragma: no cover - loaded a moment ago
                raise StorageError(f"Redis lost script {script.name} right after loading it") from exc

    def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return list(pipe.execute())
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc

    def close(self) -> None:
        while self._free:
            self._free.pop().disconnect()
        self._pool.disconnect()


class ClusterStore:
    """A Redis Cluster through redis-py's cluster client."""

    def __init__(self, cluster: redis.cluster.RedisCluster) -> None:
        self._cluster = cluster

    def client(self) -> redis.cluster.RedisCluster:
        return self._cluster

    def run(self, script: LuaScript, args: list[bytes]) -> Any:
        try:
            try:
                return self._cluster.evalsha(script.sha.decode(), *args)  # type: ignore[arg-type]
            except NoScriptError:
                self._cluster.script_load(script.source)
                return self._cluster.evalsha(script.sha.decode(), *args)  # type: ignore[arg-type]
        except RedisError as exc:
            raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc

    def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        try:
            return [self._cluster.hgetall(key) for key in keys]  # type: ignore[misc]
        except RedisError as exc:
            raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc

    def close(self) -> None:
        self._cluster.close()

"""Synchronous Redis stores: the thin I/O shell under :class:`geolimit.Limiter`.

:class:`RedisStore` talks to one Redis server. Script calls take a lean path:
arguments are packed once as RESP bytes and sent on a connection taken from a
lock-free free list, skipping redis-py's generic command pipeline (which costs
more than the script itself). Everything else goes through a normal redis-py
client on the same connection settings.

Scripts of the function library (:func:`~geolimit.store.scripts.function_library`)
run with ``FCALL`` where the server has functions (Redis >= 7). A store tries
``FCALL`` first; when the function is missing (never loaded, ``FUNCTION FLUSH``, a new
master) it loads the library (``FUNCTION LOAD REPLACE``) and calls again. A server
without ``FCALL`` (6.2) or one that refuses the load (an ACL) is used with ``EVALSHA``
from then on.

:class:`ClusterStore` wraps redis-py's :class:`~redis.cluster.RedisCluster`;
every script call carries keys of one hash slot, so redis-py routes it.

redis-py errors never escape: they become :class:`~geolimit.errors.StorageError`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import redis
import redis.cluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from geolimit.errors import StorageError
from geolimit.store.protocol import pack_command
from geolimit.store.scripts import LuaScript, function_library

__all__ = ["ClusterStore", "RedisStore", "SyncStore", "describe_error", "function_missing"]

log = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _FunctionMissing(StorageError):
    """FCALL found no such function (or no FCALL at all): load the library again."""


def function_missing(exc: BaseException) -> bool:
    """Whether a reply error says the called function (or FCALL itself) is unknown or,
    for this user, not allowed: then the library is loaded again, or EVALSHA used."""
    text = str(exc)
    return isinstance(exc, NoPermissionError) or (
        isinstance(exc, ResponseError)
        and (text.startswith("Function not found") or text.lower().startswith("unknown command"))
    )


def fcall_prefix(function: bytes, nargs: int) -> bytes:
    """RESP header of ``FCALL function`` followed by ``nargs`` more arguments."""
    return b"*%d\r\n$5\r\nFCALL\r\n$%d\r\n%b\r\n" % (nargs + 2, len(function), function)


def load_refused(exc: BaseException) -> bool:
    """Whether a failed FUNCTION LOAD was the server's answer (not a lost connection)."""
    return isinstance(exc, ResponseError) or isinstance(exc.__cause__, ResponseError)


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
        #: FCALL for library scripts: None untried, True working, False (EVALSHA) refused.
        self.functions: bool | None = None

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
                if function_missing(exc):
                    raise _FunctionMissing(str(exc)) from exc
                raise StorageError(f"Redis error: {describe_error(exc)}") from exc
            except BaseException:
                conn.disconnect()
                raise
            self._free.append(conn)
            return reply

    def load_functions(self) -> bool:
        """FUNCTION LOAD the library; False (use EVALSHA) if the server refuses it."""
        try:
            self._roundtrip(pack_command(b"FUNCTION", b"LOAD", b"REPLACE", function_library().source))
            self.functions = True
        except StorageError as exc:
            if not load_refused(exc):
                raise
            log.debug("Redis functions unavailable, using EVALSHA: %s", exc)
            self.functions = False
        return self.functions

    def run(self, script: LuaScript, args: list[bytes]) -> Any:
        return self.run_resp(script, len(args), b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args))

    def run_resp(self, script: LuaScript, nargs: int, body: bytes) -> Any:
        """FCALL or EVALSHA with arguments already RESP-encoded in ``body``."""
        if script.function is not None and self.functions is not False:
            packed = fcall_prefix(script.function, nargs) + body
            try:
                reply = self._roundtrip(packed)
                self.functions = True
                return reply
            except _FunctionMissing:
                if self.load_functions():
                    try:
                        return self._roundtrip(packed)
                    except _FunctionMissing as exc:  # pragma: no cover - loaded a moment ago
                        raise StorageError(f"Redis lost function {script.name} right after loading it") from exc
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
        #: FCALL for library scripts: None untried, True working, False (EVALSHA) refused.
        self.functions: bool | None = None

    def client(self) -> redis.cluster.RedisCluster:
        return self._cluster

    def load_functions(self) -> bool:
        """FUNCTION LOAD the library on every master; False (use EVALSHA) if refused."""
        try:
            self._cluster.function_load(function_library().source.decode(), replace=True)
            self.functions = True
        except ResponseError as exc:
            log.debug("Redis functions unavailable, using EVALSHA: %s", exc)
            self.functions = False
        return self.functions

    def _fcall(self, function: bytes, args: list[bytes]) -> Any:
        # Routed by the first key: redis-py would ask the server (COMMAND GETKEYS)
        # where FCALL's keys are on every call. A MOVED reply re-routes as usual.
        if args[0] == b"0":
            return self._cluster.fcall(function.decode(), *args)  # type: ignore[arg-type]
        node = self._cluster.get_node_from_key(args[1])  # type: ignore[no-untyped-call]
        return self._cluster.execute_command(  # type: ignore[no-untyped-call]
            "FCALL", function, *args, target_nodes=node
        )

    def run(self, script: LuaScript, args: list[bytes]) -> Any:
        try:
            if script.function is not None and self.functions is not False:
                try:
                    reply = self._fcall(script.function, args)
                    self.functions = True
                    return reply
                except ResponseError as exc:
                    if not function_missing(exc):
                        raise
                if self.load_functions():
                    return self._fcall(script.function, args)
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

"""The asyncio Redis Cluster store: :class:`AsyncClusterStore`, through redis-py's cluster client.

The single-server store and the :class:`~geolimit.store.async_store.AsyncStore`
protocol they both follow are in :mod:`geolimit.store.async_store`, which
re-exports this class.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio.cluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from geolimit.errors import StorageError
from geolimit.store.redis_store import describe_error, function_missing, log
from geolimit.store.scripts import LuaScript, function_library

__all__ = ["AsyncClusterStore"]


class AsyncClusterStore:
    """A Redis Cluster through redis-py's asyncio cluster client.

    The client learns the slot map on first use. Used concurrently before that
    (a gather of script calls), redis-py 8.1 may fail with an ``AttributeError``
    from a half-set-up connection, so the map is loaded once, under a lock,
    before any command. Any other unexpected client failure becomes a
    :class:`StorageError`, so the caller's ``on_error`` policy applies.
    """

    clustered = True

    def __init__(self, cluster: redis.asyncio.cluster.RedisCluster) -> None:
        self._cluster = cluster
        self._ready = False
        self._lock: asyncio.Lock | None = None
        #: FCALL for library scripts: None untried, True working, False (EVALSHA) refused.
        self.functions: bool | None = None

    def client(self) -> redis.asyncio.cluster.RedisCluster:
        return self._cluster

    async def _initialize(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._ready:
                await self._cluster.initialize()
                self._ready = True

    async def load_functions(self) -> bool:
        """FUNCTION LOAD the library on every master; False (use EVALSHA) if refused."""
        try:
            await self._cluster.function_load(function_library().source.decode(), replace=True)
            self.functions = True
        except ResponseError as exc:
            log.debug("Redis functions unavailable, using EVALSHA: %s", exc)
            self.functions = False
        return self.functions

    async def _fcall(self, function: bytes, args: list[bytes]) -> Any:
        # Routed by the first key: redis-py would ask the server (COMMAND GETKEYS)
        # where FCALL's keys are on every call. A MOVED reply re-routes as usual.
        if args[0] == b"0":
            return await self._cluster.fcall(function.decode(), *args)  # type: ignore[arg-type]
        node = self._cluster.get_node_from_key(args[1])  # type: ignore[arg-type]
        return await self._cluster.execute_command("FCALL", function, *args, target_nodes=node)

    async def _run_function(self, script: LuaScript, args: list[bytes]) -> tuple[bool, Any]:
        """(True, reply) if FCALL ran ``script``; (False, None) if EVALSHA must."""
        if script.function is None or self.functions is False:
            return False, None
        try:
            reply = await self._fcall(script.function, args)
            self.functions = True
            return True, reply
        except ResponseError as exc:
            if not function_missing(exc):
                raise
        if await self.load_functions():
            return True, await self._fcall(script.function, args)
        return False, None

    async def run(self, script: LuaScript, args: list[bytes]) -> Any:
        sha = script.sha.decode()
        try:
            if not self._ready:
                await self._initialize()
            done, reply = await self._run_function(script, args)
            if done:
                return reply
            try:
                return await self._cluster.evalsha(sha, *args)  # type: ignore[arg-type]
            except NoScriptError:
                await self._cluster.script_load(script.source)
                return await self._cluster.evalsha(sha, *args)  # type: ignore[arg-type]
        except RedisError as exc:
            raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc
        except (RedisClusterException, AttributeError, TypeError, IndexError, KeyError) as exc:
            # RedisClusterException is not a RedisError; the others are the client's own bugs.
            raise StorageError(f"Redis Cluster client failed: {type(exc).__name__}: {exc}") from exc

    async def run_many(self, script: LuaScript, calls: list[list[bytes]], per_trip: int | None = None) -> list[Any]:
        async def one(args: list[bytes]) -> Any:
            try:
                return await self.run(script, args)
            except StorageError as exc:
                return exc

        if not self._ready and calls:
            try:
                await self._initialize()
            except (RedisError, RedisClusterException) as exc:
                raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc
        replies: list[Any] = []
        step = per_trip or max(1, len(calls))  # per_trip calls in all at a time: a bound on every node
        for start in range(0, len(calls), step):
            replies += await asyncio.gather(*(one(args) for args in calls[start : start + step]))
        return replies

    async def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        try:
            if not self._ready:
                await self._initialize()
            return [await self._cluster.hgetall(key) for key in keys]  # type: ignore[misc]
        except (RedisError, RedisClusterException) as exc:
            raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc

    async def close(self) -> None:
        await self._cluster.aclose()

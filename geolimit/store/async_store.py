"""Asyncio Redis stores: the I/O shell under :class:`geolimit.AsyncLimiter`.

Same contract as :mod:`geolimit.store.redis_store`, with ``await``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from geolimit.errors import StorageError
from geolimit.store.protocol import pack_command
from geolimit.store.redis_store import describe_error
from geolimit.store.scripts import LuaScript

__all__ = ["AsyncClusterStore", "AsyncRedisStore", "AsyncStore"]


class AsyncStore(Protocol):
    clustered: bool

    async def run(self, script: LuaScript, args: list[bytes]) -> Any: ...

    async def run_many(self, script: LuaScript, calls: list[list[bytes]]) -> list[Any]:
        """Several calls of one script; each reply or the exception it raised."""

    async def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]: ...

    def client(self) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster: ...

    async def close(self) -> None: ...


class AsyncRedisStore:
    """One Redis server; script calls use pre-packed RESP on a free list of connections."""

    clustered = False

    def __init__(self, pool: redis.asyncio.ConnectionPool) -> None:
        self._pool = pool
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._free: list[Any] = []

    def client(self) -> redis.asyncio.Redis:
        return self._client

    async def _roundtrip(self, packed: bytes) -> Any:
        reused = bool(self._free)
        conn = self._free.pop() if reused else self._pool.connection_class(**self._pool.connection_kwargs)
        while True:
            try:
                await conn.send_packed_command([packed], check_health=False)
                reply = await conn.read_response()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                await conn.disconnect()
                if reused and not isinstance(exc, RedisTimeoutError):
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
                # Cancelled mid-reply: the connection's stream position is unknown.
                await conn.disconnect()
                raise
            self._free.append(conn)
            return reply

    async def run(self, script: LuaScript, args: list[bytes]) -> Any:
        return await self.run_resp(
            script, len(args), b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)
        )

    async def run_resp(self, script: LuaScript, nargs: int, body: bytes) -> Any:
        """EVALSHA with arguments already RESP-encoded in ``body``."""
        packed = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b" % (nargs + 2, script.sha, body)
        try:
            return await self._roundtrip(packed)
        except NoScriptError:
            await self._roundtrip(pack_command(b"SCRIPT", b"LOAD", script.source))
            try:
                return await self._roundtrip(packed)
            except NoScriptError as exc:  # pragma: no cover
                raise StorageError(f"Redis lost script {script.name} right after loading it") from exc

    async def run_many(self, script: LuaScript, calls: list[list[bytes]], per_trip: int = 8) -> list[Any]:
        """Pipelined on one connection, ``per_trip`` calls per round trip.

        Redis answers a pipelined batch only once it has run all of it, so long
        scripts are sent in small groups: each round trip stays well within the
        socket timeout.
        """
        if not calls:
            return []
        packed = [pack_command(b"EVALSHA", script.sha, *args) for args in calls]
        replies = []
        for start in range(0, len(packed), per_trip):
            replies += await self._pipeline(packed[start : start + per_trip])
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            await self._roundtrip(pack_command(b"SCRIPT", b"LOAD", script.source))
            for i, reply in zip(missing, await self._pipeline([packed[i] for i in missing]), strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, packed: list[bytes]) -> list[Any]:
        conn = self._free.pop() if self._free else self._pool.connection_class(**self._pool.connection_kwargs)
        replies: list[Any] = []
        try:
            await conn.send_packed_command([b"".join(packed)], check_health=False)
            for _ in packed:
                try:
                    replies.append(await conn.read_response())
                except NoScriptError as exc:
                    replies.append(exc)
                except RedisError as exc:
                    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
                        raise
                    replies.append(StorageError(f"Redis error: {describe_error(exc)}"))
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            await conn.disconnect()
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc
        except BaseException:
            await conn.disconnect()
            raise
        self._free.append(conn)
        return replies

    async def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                return list(await pipe.execute())
        except RedisError as exc:
            raise StorageError(f"Redis unreachable: {describe_error(exc)}") from exc

    async def close(self) -> None:
        while self._free:
            await self._free.pop().disconnect()
        await self._client.aclose()
        await self._pool.disconnect()


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

    def client(self) -> redis.asyncio.cluster.RedisCluster:
        return self._cluster

    async def _initialize(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._ready:
                await self._cluster.initialize()
                self._ready = True

    async def run(self, script: LuaScript, args: list[bytes]) -> Any:
        sha = script.sha.decode()
        try:
            if not self._ready:
                await self._initialize()
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

    async def run_many(self, script: LuaScript, calls: list[list[bytes]]) -> list[Any]:
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
        return list(await asyncio.gather(*(one(args) for args in calls)))

    async def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]:
        try:
            if not self._ready:
                await self._initialize()
            return [await self._cluster.hgetall(key) for key in keys]  # type: ignore[misc]
        except (RedisError, RedisClusterException) as exc:
            raise StorageError(f"Redis Cluster error: {describe_error(exc)}") from exc

    async def close(self) -> None:
        await self._cluster.aclose()

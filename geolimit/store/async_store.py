"""Asyncio Redis stores: the I/O shell under :class:`geolimit.AsyncLimiter`.

Same contract as :mod:`geolimit.store.redis_store`, with ``await`` (FCALL for the
function library's scripts where the server has functions, else EVALSHA).
The Redis Cluster store, :class:`AsyncClusterStore`, is in
:mod:`geolimit.store.async_cluster` (importable from here as well).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from geolimit.errors import StorageError

try:  # redis-py's private hiredis parser: the lean round trip below uses it when it is there
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
except ImportError:  # pragma: no cover - another redis-py layout: every call takes redis-py's own path
    NOT_ENOUGH_DATA = object()
    _AsyncHiredisParser = type(None)  # type: ignore[misc, assignment]

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - redis-py's dependency there
    from async_timeout import timeout as _timeout  # type: ignore[import-not-found, unused-ignore]
from geolimit.store.async_cluster import AsyncClusterStore
from geolimit.store.protocol import pack_command
from geolimit.store.redis_store import (
    _FunctionMissing,
    describe_error,
    fcall_prefix,
    function_missing,
    load_refused,
    log,
)
from geolimit.store.scripts import LuaScript, function_library

__all__ = ["AsyncClusterStore", "AsyncRedisStore", "AsyncStore", "checked_replies", "surviving"]


class AsyncStore(Protocol):
    clustered: bool

    async def run(self, script: LuaScript, args: list[bytes]) -> Any: ...

    async def run_many(self, script: LuaScript, calls: list[list[bytes]], per_trip: int | None = None) -> list[Any]:
        """Several calls of one script; each reply or the exception it raised.

        With ``per_trip``, at most that many calls are sent to Redis at a time (the
        store's own default otherwise).
        """

    async def read(self, keys: list[bytes]) -> list[dict[bytes, bytes]]: ...

    def client(self) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster: ...

    async def close(self) -> None: ...


def checked_replies(replies: list[Any]) -> list[Any]:
    """``run_many``'s replies, or the first call's error raised (as a StorageError)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply if isinstance(reply, StorageError) else StorageError(str(reply))
    return replies


def surviving(replies: list[Any], shards: Sequence[int], failed: dict[int, str]) -> list[Any]:
    """``run_many``'s replies of per-shard calls, with None for each call that failed.

    The failed calls' shards go into ``failed`` with their error: on a Redis
    Cluster one node down must not stop the work of the others' shards. When
    every call failed (Redis is down, not one node), the first error is raised
    as :func:`checked_replies` would.
    """
    out: list[Any] = []
    first: BaseException | None = None
    for shard, reply in zip(shards, replies, strict=True):
        if isinstance(reply, Exception):
            first = first or reply
            failed[shard] = str(reply)[:300]
            out.append(None)
        else:
            out.append(reply)
    if first is not None and all(reply is None for reply in out):
        raise first if isinstance(first, StorageError) else StorageError(str(first))
    return out


async def _exchange(conn: Any, parser: Any, packed: bytes) -> Any:
    """One command and its reply on a connected redis-py connection, without its per-call layers (a task
    per write, timeout and health bookkeeping): about half the CPU of send_packed_command + read_response.

    The same stream and hiredis reader as redis-py's, so the connection stays usable by it, and the
    same outcomes: a reply error raised as redis-py's class for it, the socket timeout as its
    TimeoutError, a closed or broken connection as its ConnectionError, RESP3 push messages given
    to redis-py's handler.
    """
    writer, stream, reader = conn._writer, conn._reader, parser._reader
    push = getattr(parser, "_hiredis_PushNotificationType", None)
    writer.write(packed)
    try:
        async with _timeout(conn.socket_timeout):
            if writer.transport.get_write_buffer_size():
                await writer.drain()
            while True:
                reply = reader.gets()
                while reply is NOT_ENOUGH_DATA:
                    data = await stream.read(65536)
                    if not data:
                        raise RedisConnectionError("Connection closed by server.")
                    reader.feed(data)
                    reply = reader.gets()
                if push is None or not isinstance(reply, push):
                    break
                await parser.handle_push_response(reply)
    except asyncio.TimeoutError:
        raise RedisTimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise RedisConnectionError(f"Error while reading from socket: {exc.args}") from exc
    if isinstance(reply, Exception):
        raise reply
    if isinstance(reply, list) and reply and isinstance(reply[0], RedisConnectionError):
        raise reply[0]
    return reply


class AsyncRedisStore:
    """One Redis server; script calls use pre-packed RESP on a free list of connections."""

    clustered = False

    def __init__(self, pool: redis.asyncio.ConnectionPool) -> None:
        self._pool = pool
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._free: list[Any] = []
        #: FCALL for library scripts: None untried, True working, False (EVALSHA) refused.
        self.functions: bool | None = None

    def client(self) -> redis.asyncio.Redis:
        return self._client

    async def _roundtrip(self, packed: bytes) -> Any:
        reused = bool(self._free)
        conn = self._free.pop() if reused else self._pool.connection_class(**self._pool.connection_kwargs)
        while True:
            try:
                if not conn.is_connected:  # connect as send_packed_command does (older redis-py: connect())
                    connect = getattr(conn, "connect_check_health", None)
                    await (connect(check_health=False) if connect is not None else conn.connect())
                parser = getattr(conn, "_parser", None)
                if isinstance(parser, _AsyncHiredisParser) and parser._connected and parser._reader is not None:
                    reply = await _exchange(conn, parser, packed)
                else:
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
                if function_missing(exc):
                    raise _FunctionMissing(str(exc)) from exc
                raise StorageError(f"Redis error: {describe_error(exc)}") from exc
            except BaseException:
                # Cancelled mid-reply: the connection's stream position is unknown.
                await conn.disconnect()
                raise
            self._free.append(conn)
            return reply

    async def run(self, script: LuaScript, args: list[bytes]) -> Any:
        return await self.run_resp(
            script, len(args), b"".join([b"$%d\r\n%b\r\n" % (len(a), a) for a in args])  # a list: faster than a generator
        )

    async def load_functions(self) -> bool:
        """FUNCTION LOAD the library; False (use EVALSHA) if the server refuses it."""
        try:
            await self._roundtrip(pack_command(b"FUNCTION", b"LOAD", b"REPLACE", function_library().source))
            self.functions = True
        except StorageError as exc:
            if not load_refused(exc):
                raise
            log.debug("Redis functions unavailable, using EVALSHA: %s", exc)
            self.functions = False
        return self.functions

    async def run_resp(self, script: LuaScript, nargs: int, body: bytes) -> Any:
        """FCALL or EVALSHA with arguments already RESP-encoded in ``body``."""
        if script.function is not None and self.functions is not False:
            packed = fcall_prefix(script.function, nargs) + body
            try:
                reply = await self._roundtrip(packed)
                self.functions = True
                return reply
            except _FunctionMissing:
                if await self.load_functions():
                    try:
                        return await self._roundtrip(packed)
                    except _FunctionMissing as exc:  # pragma: no cover - loaded a moment ago
                        raise StorageError(f"Redis lost function {script.name} right after loading it") from exc
        packed = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b" % (nargs + 2, script.sha, body)
        try:
            return await self._roundtrip(packed)
        except NoScriptError:
            await self._roundtrip(pack_command(b"SCRIPT", b"LOAD", script.source))
            try:
                return await self._roundtrip(packed)
            except NoScriptError as exc:  # pragma: no cover
                raise StorageError(f"Redis lost script {script.name} right after loading it") from exc

    async def run_many(self, script: LuaScript, calls: list[list[bytes]], per_trip: int | None = None) -> list[Any]:
        """Pipelined on one connection, ``per_trip`` calls (default 8) per round trip.

        Redis answers a pipelined batch only once it has run all of it, so long
        scripts are sent in small groups: each round trip stays well within the
        socket timeout.
        """
        if not calls:
            return []
        per_trip = per_trip or 8
        if script.function is not None and self.functions is not False:
            replies = await self._pipelined(script, [pack_command(b"FCALL", script.function, *a) for a in calls], per_trip)
            missing = [i for i, r in enumerate(replies) if isinstance(r, _FunctionMissing)]
            if len(missing) < len(replies):
                self.functions = True
            if not missing:
                return replies
            if await self.load_functions():
                redo = [pack_command(b"FCALL", script.function, *calls[i]) for i in missing]
            else:
                redo = [pack_command(b"EVALSHA", script.sha, *calls[i]) for i in missing]
            for i, reply in zip(missing, await self._pipelined(script, redo, per_trip), strict=True):
                replies[i] = reply
            return replies
        return await self._pipelined(script, [pack_command(b"EVALSHA", script.sha, *a) for a in calls], per_trip)

    async def _pipelined(self, script: LuaScript, packed: list[bytes], per_trip: int) -> list[Any]:
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
                    if function_missing(exc):
                        replies.append(_FunctionMissing(str(exc)))
                    else:
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

"""A TCP proxy with injectable network faults, for tests and demos on loopback.

:class:`FaultyLink` listens on ``127.0.0.1`` and forwards every accepted
connection to one target. Each direction (``"up"``: client to target,
``"down"``: target to client) has its own one-way latency with jitter and its
own black-hole switch; :meth:`FaultyLink.partition` cuts the whole link.

Delay model: a chunk read at time ``t`` is released at ``t + max(0, latency +
U(-jitter, +jitter))`` (``U`` drawn from the injected :class:`random.Random`).
Each connection direction has one FIFO queue and one writer task, so a chunk is
never written before an earlier chunk of the same stream: the effective delay
of a chunk is ``max(its own release time, the previous chunk's write time)``.
Byte order inside a TCP stream is always preserved.

Black hole (:meth:`FaultyLink.block`): a chunk is discarded when its direction
is blocked at the moment it is read *or* at the moment it would be written (a
packet in flight on a failed link is lost too). EOF in a blocked direction is
discarded as well; the connection stays open, so the sender only sees a timeout.

Partition: existing connections are aborted on both sides (the peers see a
reset); new connections are accepted by the kernel and aborted at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Literal

from geolimit.errors import ConfigError, NetsimError, RequestError

__all__ = ["DIRECTIONS", "Direction", "FaultyLink", "Latency", "LinkStats", "NetsimError"]

log = logging.getLogger("geolimit.netsim")

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, Direction] = ("up", "down")
_CHUNK = 64 * 1024
#: Network errors that end one proxied connection (not the link).
_NET_ERRORS = (ConnectionError, OSError, asyncio.IncompleteReadError)


@dataclass(frozen=True, slots=True)
class Latency:
    """One-way delay of a direction, in seconds."""

    latency: float = 0.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (self.latency >= 0.0 and self.jitter >= 0.0):
            raise ConfigError(f"latency and jitter must be >= 0, got {self.latency}, {self.jitter}")


@dataclass(slots=True)
class LinkStats:
    """Counters of a :class:`FaultyLink` (a snapshot when read through ``link.stats``)."""

    accepted: int = 0  # connections proxied to the target
    refused: int = 0  # connections aborted on arrival because of a partition
    upstream_failures: int = 0  # connections aborted because the target did not answer
    cut: int = 0  # established connections aborted by partition()
    active: int = 0  # connections open right now
    forwarded: dict[Direction, int] = field(default_factory=lambda: {"up": 0, "down": 0})  # bytes
    dropped: dict[Direction, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    chunks: dict[Direction, int] = field(default_factory=lambda: {"up": 0, "down": 0})  # writes


def _check_direction(direction: str) -> tuple[Direction, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction == "up":
        return ("up",)
    if direction == "down":
        return ("down",)
    raise RequestError(f"direction must be 'up', 'down' or 'both', not {direction!r}")


class _Connection:
    """One proxied connection: a reader task and a writer task per direction."""

    def __init__(
        self,
        link: FaultyLink,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.link = link
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []
        self.was_cut = False

    async def run(self, name: str) -> None:
        ends = {"up": (self.client[0], self.server[1]), "down": (self.server[0], self.client[1])}
        for direction in DIRECTIONS:
            queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
            reader, writer = ends[direction]
            self.tasks.append(
                asyncio.create_task(self._read(direction, reader, queue), name=f"{name}-{direction}-read")
            )
            self.tasks.append(
                asyncio.create_task(self._write(direction, writer, queue), name=f"{name}-{direction}-write")
            )
        try:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            crash: BaseException | None = None
            clean = True
            for task in self.tasks:
                if task.cancelled():
                    clean = False
                    continue
                exc = task.exception()
                if exc is not None:
                    clean = False
                    if not isinstance(exc, _NET_ERRORS) and crash is None:
                        crash = exc
            self.close(abort=not clean)
            if crash is not None:
                self.link._crashed(crash)

    async def _read(
        self,
        direction: Direction,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes | None]],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(_CHUNK)
            now = loop.time()
            if not data:
                queue.put_nowait((now, None))
                return
            if direction in self.link._blocked:
                self.link._stats.dropped[direction] += len(data)
                continue
            queue.put_nowait((now + self.link._delay(direction), data))

    async def _write(
        self,
        direction: Direction,
        writer: asyncio.StreamWriter,
        queue: asyncio.Queue[tuple[float, bytes | None]],
    ) -> None:
        loop = asyncio.get_running_loop()
        stats = self.link._stats
        while True:
            release, data = await queue.get()
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                if direction not in self.link._blocked and writer.can_write_eof():
                    writer.write_eof()
                return
            if direction in self.link._blocked:
                stats.dropped[direction] += len(data)
                continue
            writer.write(data)
            await writer.drain()
            stats.forwarded[direction] += len(data)
            stats.chunks[direction] += 1

    def close(self, abort: bool) -> None:
        for _, writer in (self.client, self.server):
            if abort:
                writer.transport.abort()
            else:
                writer.close()

    def cut(self, by_partition: bool) -> None:
        self.was_cut = self.was_cut or by_partition
        self.close(abort=True)
        for task in self.tasks:
            task.cancel()


class FaultyLink:
    """An asyncio TCP proxy on 127.0.0.1 with per-direction latency, black holes and partitions."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_port: int = 0,
        rng: random.Random | None = None,
        up: Latency | None = None,
        down: Latency | None = None,
        connect_timeout: float = 5.0,
        name: str = "faultylink",
    ) -> None:
        self.target = (target_host, target_port)
        self.name = name
        self._listen_port = listen_port
        self._rng = rng if rng is not None else random.Random()
        self._latency: dict[Direction, Latency] = {"up": up or Latency(), "down": down or Latency()}
        self._connect_timeout = connect_timeout
        self._blocked: set[Direction] = set()
        self._partitioned = False
        self._stats = LinkStats()
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[object]] = set()
        self._failure: BaseException | None = None
        self._serial = 0

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> FaultyLink:
        if self._server is not None:
            raise NetsimError(f"{self.name} is already started")
        self._check()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self._listen_port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        """Close the listener and every connection; raise :class:`NetsimError` if a task crashed."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for conn in list(self._connections):
                conn.cut(by_partition=False)
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*list(self._handlers), return_exceptions=True)
            await server.wait_closed()
        self._check()

    async def __aenter__(self) -> FaultyLink:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- addresses --------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise NetsimError(f"{self.name} has not been started")
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- controls ---------------------------------------------------------------

    def set_latency(self, direction: Direction | Literal["both"], latency: float, jitter: float = 0.0) -> None:
        """Delay chunks read from now on; ``direction`` may be ``"both"``."""
        self._check()
        value = Latency(latency, jitter)
        for d in _check_direction(direction):
            self._latency[d] = value

    def latency(self, direction: Direction) -> Latency:
        return self._latency[_check_direction(direction)[0]]

    def block(self, direction: Direction | Literal["both"]) -> None:
        """Black-hole one direction (``"both"``: every byte, connections stay open)."""
        self._check()
        self._blocked.update(_check_direction(direction))

    def unblock(self, direction: Direction | Literal["both"] = "both") -> None:
        self._check()
        self._blocked.difference_update(_check_direction(direction))

    @property
    def blocked(self) -> frozenset[Direction]:
        return frozenset(self._blocked)

    def partition(self) -> None:
        """Cut every connection now and abort new ones until :meth:`heal`."""
        self._check()
        self._partitioned = True
        for conn in list(self._connections):
            conn.cut(by_partition=True)

    def heal(self) -> None:
        self._check()
        self._partitioned = False

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    @property
    def stats(self) -> LinkStats:
        """A snapshot of the counters."""
        s = self._stats
        return replace(s, forwarded=dict(s.forwarded), dropped=dict(s.dropped), chunks=dict(s.chunks))

    @property
    def failure(self) -> BaseException | None:
        """The exception of a crashed background task, if any."""
        return self._failure

    # -- internals --------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            raise NetsimError(f"{self.name}: a background task crashed: {self._failure!r}") from self._failure

    def _crashed(self, exc: BaseException) -> None:
        log.error("%s: background task crashed", self.name, exc_info=exc)
        if self._failure is None:
            self._failure = exc

    def _delay(self, direction: Direction) -> float:
        setting = self._latency[direction]
        if setting.jitter == 0.0:
            return setting.latency
        return max(0.0, setting.latency + self._rng.uniform(-setting.jitter, setting.jitter))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serial += 1
        name = f"{self.name}-conn{self._serial}"
        task.set_name(name)
        self._handlers.add(task)
        try:
            await self._proxy(name, reader, writer)
        except asyncio.CancelledError:
            # This is the connection's top-level task (nothing awaits it), so it
            # ends normally: on Python 3.11, asyncio's own done-callback for a
            # cancelled connection handler logs a spurious CancelledError traceback.
            writer.transport.abort()
        except Exception as exc:  # a bug: never let the handler die quietly
            writer.transport.abort()
            self._crashed(exc)
        finally:
            self._handlers.discard(task)

    async def _proxy(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned or self._server is None:
            self._stats.refused += 1
            writer.transport.abort()
            return
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*self.target), self._connect_timeout)
        except (*_NET_ERRORS, asyncio.TimeoutError) as exc:
            log.warning("%s: cannot reach %s:%s: %r", self.name, *self.target, exc)
            self._stats.upstream_failures += 1
            writer.transport.abort()
            return
        conn = _Connection(self, (reader, writer), upstream)
        if self._partitioned or self._server is None:  # changed while connecting
            self._stats.refused += 1
            conn.close(abort=True)
            return
        self._stats.accepted += 1
        self._stats.active += 1
        self._connections.add(conn)
        try:
            await conn.run(name)
        finally:
            self._connections.discard(conn)
            self._stats.active -= 1
            if conn.was_cut:
                self._stats.cut += 1

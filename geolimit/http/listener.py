"""Listening sockets and the event loop of the agent's and the proxy's aiohttp servers.

:func:`listen` binds the sockets itself (``SO_REUSEADDR``, and ``SO_REUSEPORT``
when several worker processes share the port, so the kernel spreads the
connections over them) and serves them under a
:class:`~geolimit.http.connections.ListenerGuard`: a deadline for each request head
and a cap on open connections (aiohttp has neither); requests aiohttp cannot parse
are logged in one line per 10 s (:mod:`geolimit.http.bad_requests`, installed by the
guard). It returns the bound address, which is how a listener on port 0 learns its port. Only public aiohttp API is used
(a :class:`aiohttp.web.BaseSite` subclass, as aiohttp's own sites are).

:func:`run_event_loop` is :func:`asyncio.run` on uvloop when it is installed
(the ``fast`` extra: ``pip install 'geolimit[fast]'``), else on asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from aiohttp import web

from geolimit.errors import GeolimitError
from geolimit.http.connections import ListenerGuard

__all__ = ["KEEPALIVE_TIMEOUT", "bind_sockets", "check_listens", "listen", "run_event_loop"]

T = TypeVar("T")

#: Seconds an idle kept-alive connection stays open on our servers (aiohttp 3.14's default,
#: 3630 s, let idle clients hold places under ``max_connections`` for an hour; nginx uses 75 s).
KEEPALIVE_TIMEOUT = 75.0


def bind_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """One bound TCP socket per address ``host`` resolves to (raises OSError).

    With ``port`` 0 every socket gets its own free port. IPv6 sockets are
    IPv6-only, so ``::`` and ``0.0.0.0`` can both be bound, as asyncio does.
    """
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("SO_REUSEPORT is not available on this platform")
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def listen(
    runner: web.BaseRunner,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
    backlog: int = 1024,
    guard: ListenerGuard | None = None,
) -> tuple[str, int]:
    """Serve ``runner`` (already set up) on ``host:port``; the first bound ``(host, port)``.

    ``guard``: the listener's head deadline and connection cap (default: a guard of
    its own with the defaults). The sites belong to ``runner``: ``runner.cleanup()``
    closes them.
    """
    sockets = bind_sockets(host, port, reuse_port=reuse_port)
    address: tuple[str, int] = sockets[0].getsockname()[:2]
    guard = guard or ListenerGuard("HTTP")
    guard.where = f"{address[0]}:{address[1]}"
    started = 0
    try:
        for sock in sockets:
            await _Site(runner, sock, guard, ssl_context=ssl_context, backlog=backlog).start()
            started += 1
    except BaseException:
        for sock in sockets[started:]:  # the started sites own (and close) theirs
            with contextlib.suppress(OSError):
                sock.close()
        raise
    return address


class _Site(web.BaseSite):
    """A listening socket served under a guard (aiohttp's ``SockSite``, with the guard's protocol)."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ListenerGuard, *,
                 ssl_context: ssl.SSLContext | None, backlog: int) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._owner, self._sock, self._guard = runner, sock, guard
        self._tls, self._queue = ssl_context, backlog
        host, port = sock.getsockname()[:2]
        self._name = f"{'https' if ssl_context else 'http'}://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._owner.server
        assert server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        # TLS: each connection makes its handshake (within head_timeout) under the guard's count
        factory = self._guard.protocol_factory(server, self._tls)
        self._server = await loop.create_server(factory, sock=self._sock, backlog=self._queue)

    async def stop(self) -> None:
        await super().stop()
        self._guard.close()


def check_listens(name: str, listens: Iterable[tuple[str, tuple[str, int]]]) -> None:
    """Bind each ``(setting, (host, port))`` once and let it go: a GeolimitError naming ``name``,
    the setting and the address that cannot be bound (a port another process holds)."""
    for key, (host, port) in listens:
        try:
            sockets = bind_sockets(host, port)
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise GeolimitError(f"{name}: cannot listen on {key} {where}: {exc}") from None
        for sock in sockets:
            sock.close()


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop if it is installed, else as :func:`asyncio.run` does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result

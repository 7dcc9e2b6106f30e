"""aiohttp rate-limiting middleware, with the same semantics as the ASGI one.

::

    app = web.Application()
    setup_geolimit(app, limiter, [policy("/api/*", "api", key="header:X-API-Key")])
    # or: web.Application(middlewares=[geolimit_middleware(limiter, routes)])

Denied requests get 429 (or 400 / 503, see :mod:`geolimit.middleware.common`)
with an ``application/problem+json`` body, and the handler never runs. Allowed
responses get the ``RateLimit-Policy`` / ``RateLimit`` headers (plus
``X-RateLimit-*`` with ``legacy_headers=True``), except names the handler set
itself; ``web.HTTPException`` raised by the handler gets them too. The
:class:`~geolimit.http.guard.Verdict` is stored on the request
(``request[VERDICT_KEY]``); its ``decision`` is ``None`` when no route matched,
the route has only shadow limits (never shown in headers; see ``verdict.shadow``)
or every limit failed open.

**Streamed responses.** A :class:`~aiohttp.web.StreamResponse` (or a
``WebSocketResponse``) that the handler has already prepared has sent its
headers, so the middleware alone cannot add to them. :func:`setup_geolimit` also
registers :func:`on_response_prepare`, which adds the headers just before *any*
response is prepared; use it (or register the hook yourself) when handlers
stream. With the bare middleware, prepared responses go out without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from multidict import CIMultiDict

from geolimit.http.agent_client import AgentClient
from geolimit.http.guard import Decider, Guard, RoutePolicy, Verdict
from geolimit.limiter import Limiter
from geolimit.middleware.common import as_decider, decide, missing, request_info
from geolimit.middleware.rules import check_agent_routes, checked_routes

__all__ = ["HEADERS_KEY", "VERDICT_KEY", "geolimit_middleware", "on_response_prepare", "setup_geolimit"]

try:  # typed request storage (aiohttp >= 3.13); plain string keys before that
    from aiohttp.web import RequestKey

    VERDICT_KEY: Any = RequestKey("geolimit_verdict", Verdict)
    HEADERS_KEY: Any = RequestKey("geolimit_headers", list)
except ImportError:  # pragma: no cover - depends on the aiohttp version
    VERDICT_KEY = "geolimit_verdict"
    HEADERS_KEY = "geolimit_headers"


def _add_headers(response: web.StreamResponse, headers: list[tuple[str, str]]) -> None:
    for name, value in missing(headers, response.headers.keys()):
        response.headers[name] = value


def geolimit_middleware(
    decider: Decider | Limiter,
    routes: Sequence[RoutePolicy],
    trusted_proxies: Sequence[str] = (),
    legacy_headers: bool = False,
) -> Middleware:
    """An aiohttp middleware limiting requests by ``routes`` (first match decides).

    ``decider`` is an :class:`~geolimit.AsyncLimiter`, an ``AgentClient`` or a
    sync :class:`~geolimit.Limiter` (run in a worker thread). ``trusted_proxies``
    as for :class:`~geolimit.middleware.GeolimitMiddleware`. With a Limiter or an AsyncLimiter, a route
    naming a rule it does not know is a :class:`~geolimit.errors.ConfigError` here (see
    :mod:`geolimit.middleware.rules`).
    """
    guard = Guard(as_decider(decider), checked_routes(decider, routes), trusted_proxies)

    @web.middleware
    async def geolimit(request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request_info(request.method, request.path, request.headers.items(), request.remote)
        verdict, reply = await decide(guard, info, legacy_headers)
        if reply is not None:
            headers = CIMultiDict((n, v) for n, v in reply.headers if n.lower() != "content-length")
            return web.Response(status=reply.status, body=reply.body, headers=headers)
        request[VERDICT_KEY] = verdict
        if verdict.decision is None:  # no route matched, only shadow limits, or all failed open
            return await handler(request)
        extra = verdict.headers(legacy_headers)
        request[HEADERS_KEY] = extra
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            _add_headers(exc, extra)
            raise
        if not response.prepared:
            _add_headers(response, extra)
        return response

    return geolimit


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """``app.on_response_prepare`` hook: adds the headers to streamed responses too."""
    extra = request.get(HEADERS_KEY)
    if extra:
        _add_headers(response, extra)


def setup_geolimit(
    app: web.Application,
    decider: Decider | Limiter,
    routes: Sequence[RoutePolicy],
    trusted_proxies: Sequence[str] = (),
    legacy_headers: bool = False,
) -> None:
    """Append the middleware to ``app.middlewares`` and register :func:`on_response_prepare`; with an
    ``AgentClient``, also an ``on_startup`` hook refusing routes that name a rule the agent does not know
    (:func:`~geolimit.middleware.rules.check_agent_routes`)."""
    app.middlewares.append(geolimit_middleware(decider, routes, trusted_proxies, legacy_headers))
    app.on_response_prepare.append(on_response_prepare)
    if isinstance(decider, AgentClient):
        agent = decider

        async def check_routes(_: web.Application) -> None:
            await check_agent_routes(agent, routes)

        app.on_startup.append(check_routes)

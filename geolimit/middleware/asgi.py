"""Pure ASGI rate-limiting middleware: Starlette, FastAPI, or any ASGI 3 application.

No framework is imported; the middleware speaks the ASGI protocol directly::

    app = FastAPI()
    app.add_middleware(GeolimitMiddleware, limiter_or_decider=limiter,
                       routes=[policy("/api/*", "api", key="header:X-API-Key")])

    app = GeolimitMiddleware.simple(app, limiter, rule="api", key="ip")   # any ASGI app

* **HTTP requests** are decided by a :class:`~geolimit.http.guard.Guard` (the
  proxy's key extractors, costs, shadow limits and fail-open/closed policies).
  A denied request is answered by the middleware itself (429, 400 or 503 with an
  ``application/problem+json`` body, see :mod:`geolimit.middleware.common`);
  the app never runs. An allowed request runs the app, and the
  ``RateLimit-Policy``/``RateLimit`` headers (plus ``X-RateLimit-*`` with
  ``legacy_headers=True``) are added to its ``http.response.start`` message,
  except for names the app set itself. The app finds the
  :class:`~geolimit.http.guard.Verdict` in ``scope["state"]["geolimit"]``
  (``request.state.geolimit`` in Starlette); its ``decision`` is ``None`` when
  no route matched, the route has only shadow limits (they never show in
  headers; see ``verdict.shadow``), or every limit failed open (see ``verdict.failed``).
* **Paths** are matched against ``scope["path"]`` as the server delivers it.
* **Client addresses** come from ``scope["client"]``. Servers may already have
  rewritten it: uvicorn's ``proxy_headers`` (on by default) replaces it with the
  ``X-Forwarded-For`` address when the peer is in ``forwarded_allow_ips``
  (127.0.0.1 by default). Configure one of the two: ``trusted_proxies`` here
  with ``proxy_headers=False`` (``--no-proxy-headers``), or uvicorn's and none here.
* **Other scopes pass through untouched**: ``lifespan`` (startup and shutdown
  must reach the app) and ``websocket``. WebSocket handshakes are *not* rate
  limited; limit the HTTP route that hands out connection tokens instead, or
  decide inside the handler with the limiter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any, Literal

from geolimit.http.guard import Decider, Guard, RoutePolicy, Verdict
from geolimit.http.keys import RequestInfo
from geolimit.limiter import Limiter
from geolimit.middleware.common import Reply, as_decider, decide, missing, policy, request_info
from geolimit.middleware.rules import checked_routes

__all__ = ["ASGIApp", "GeolimitMiddleware", "Message", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATE_KEY = "geolimit"


def _request_info(scope: Scope) -> RequestInfo:
    raw: Iterable[tuple[bytes, bytes]] = scope.get("headers") or ()
    headers = ((bytes(name).decode("latin-1"), bytes(value).decode("latin-1")) for name, value in raw)
    client = scope.get("client")
    peer = str(client[0]) if client else None
    return request_info(str(scope.get("method", "GET")), str(scope.get("path", "/")), headers, peer)


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]


class GeolimitMiddleware:
    """Rate-limits HTTP requests before they reach ``app`` (see the module docstring).

    ``limiter_or_decider`` is an :class:`~geolimit.AsyncLimiter` (best), a
    :class:`~geolimit.http.agent_client.AgentClient`, or a sync
    :class:`~geolimit.Limiter` (decided in a worker thread). ``routes`` are tried
    in order and the first match decides; unmatched requests are not limited.
    With a Limiter or an AsyncLimiter, a route naming a rule it does not know is a
    :class:`~geolimit.errors.ConfigError` here (see :mod:`geolimit.middleware.rules`); with an
    AgentClient, await :func:`~geolimit.middleware.rules.check_agent_routes` in the app's startup.
    ``trusted_proxies`` (addresses or CIDRs) may set ``Forwarded`` /
    ``X-Forwarded-For`` for the ``ip`` key; other peers cannot spoof it.
    """

    def __init__(
        self,
        app: ASGIApp,
        limiter_or_decider: Decider | Limiter,
        routes: Sequence[RoutePolicy],
        trusted_proxies: Sequence[str] = (),
        legacy_headers: bool = False,
    ) -> None:
        self.app = app
        self.guard = Guard(as_decider(limiter_or_decider), checked_routes(limiter_or_decider, routes),
                           trusted_proxies)
        self.legacy_headers = legacy_headers

    @classmethod
    def simple(
        cls,
        app: ASGIApp,
        limiter: Decider | Limiter,
        rule: str = "api",
        key: str = "ip",
        *,
        cost: int | str = 1,
        path: str = "/*",
        methods: Iterable[str] | None = None,
        shadow: bool = False,
        on_error: Literal["allow", "deny"] = "allow",
        trusted_proxies: Sequence[str] = (),
        legacy_headers: bool = False,
    ) -> GeolimitMiddleware:
        """One limit on every request (or on ``path``): ``GeolimitMiddleware.simple(app, limiter)``."""
        route = policy(path, rule, key=key, cost=cost, methods=methods, shadow=shadow, on_error=on_error)
        return cls(app, limiter, [route], trusted_proxies=trusted_proxies, legacy_headers=legacy_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan, websocket: untouched
            return
        verdict, reply = await decide(self.guard, _request_info(scope), self.legacy_headers)
        if reply is not None:
            await self._send_reply(scope, send, reply)
            return
        scope = {**scope, "state": {**(scope.get("state") or {}), STATE_KEY: verdict}}
        if verdict.decision is None:  # no route matched, only shadow limits, or all failed open
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, self._with_headers(send, verdict))

    def _with_headers(self, send: Send, verdict: Verdict) -> Send:
        extra = verdict.headers(self.legacy_headers)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                own = list(message.get("headers") or ())
                present = [bytes(name).decode("latin-1") for name, _ in own]
                message = {**message, "headers": own + _encode(missing(extra, present))}
            await send(message)

        return send_with_headers

    @staticmethod
    async def _send_reply(scope: Scope, send: Send, reply: Reply) -> None:
        await send({"type": "http.response.start", "status": reply.status, "headers": _encode(reply.headers)})
        body = b"" if scope.get("method") == "HEAD" else reply.body
        await send({"type": "http.response.body", "body": body, "more_body": False})

"""The :class:`Proxy`: listeners, upstream connection pool, decider, reload and graceful stop.

::

    async with Proxy(load_proxy_config("proxy.toml")) as proxy:
        print(proxy.url, proxy.admin_url)

The proxied listener serves nothing of its own (every path goes upstream). The
optional admin listener (``admin_listen``) serves ``/metrics`` (Prometheus),
``/healthz`` (200 while the process runs) and ``/readyz`` (200 once started,
503 while stopping). Readiness does not depend on Redis or the agent: the
limits' ``on_error`` policies decide what happens without them.

With ``config.workers`` > 1 this is worker ``worker_index`` of a supervisor
(``geolimit proxy --workers N``): it binds its listeners with ``SO_REUSEPORT``
and its ``/metrics`` describe every worker (geolimit/proxy/metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import fields

import aiohttp
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from geolimit.async_limiter import AsyncLimiter
from geolimit.errors import ConfigError, GeolimitError, StorageError
from geolimit.http.agent_client import AgentClient, AgentRules
from geolimit.http.connections import ListenerGuard, default_max_connections
from geolimit.http.guard import Guard
from geolimit.http.keys import trusted_networks
from geolimit.http.listener import KEEPALIVE_TIMEOUT, bind_sockets, listen
from geolimit.proxy.agent_rules import RETRY_INTERVAL, resolve_routes
from geolimit.proxy.config import ProxyConfig
from geolimit.proxy.decider import ProxyDecider
from geolimit.proxy.fast_forward import FastForwarder
from geolimit.proxy.fast_server import HEAD_TIMEOUT, FastServer
from geolimit.proxy.fast_upstream import UpstreamPool
from geolimit.proxy.handler import SMALL_BODY, Forwarder, State, upstream_for
from geolimit.proxy.metrics import CONTENT_TYPE, ProxyMetrics

__all__ = ["Proxy"]

log = logging.getLogger("geolimit.proxy")

#: Settings a reload cannot change (reported, not applied).
_RESTART = ("listen", "admin_listen", "redis_url", "agent_url", "agent_token", "region", "key_prefix", "shards",
            "decision_timeout", "log_format", "log_level", "workers", "fast_path")
#: Request headers aiohttp's client would add on its own: the proxy sends only the client's.
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def _state(config: ProxyConfig, decider: ProxyDecider) -> State:
    return State(
        config=config,
        guard=Guard(decider, config.routes, config.trusted_proxies),
        trusted=trusted_networks(config.trusted_proxies),
        upstreams=tuple(upstream_for(u) for u in config.upstreams),
        timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=config.connect_timeout,
                                      sock_read=config.timeout),
        checked_costs=frozenset(
            id(p) for p in config.routes if any(not isinstance(limit.cost.spec, int) for limit in p.limits)),
    )


class Proxy:
    """A rate-limiting reverse proxy (see the package docstring)."""

    def __init__(self, config: ProxyConfig, *, reuse_port: bool = False, worker_index: int = 0) -> None:
        self.config = config
        # Several worker processes share the listeners (SO_REUSEPORT).
        self.reuse_port = reuse_port or config.workers > 1
        self.worker_index = worker_index
        self.metrics = ProxyMetrics(worker=worker_index, workers=config.workers)
        self.decider: ProxyDecider | None = None
        self.forwarder: Forwarder | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runners: list[web.BaseRunner] = []
        self._fast: FastServer | None = None
        self._addresses: list[tuple[str, int]] = []
        self._ready = False
        self._agent_rules: AgentRules | None = None  # agent mode: what the agent decides, once it answered
        self._learning: asyncio.Task[None] | None = None  # agent mode: asking an agent that did not answer

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Connect the decider and bind the listener(s).

        A rule whose window disagrees with the region's Redis, or (agent mode) a limit
        naming a rule the agent does not decide, is a ConfigError; an unreachable Redis
        or agent is not (the limits fail open or closed; geolimit/proxy/agent_rules.py).
        """
        cfg = self.config
        if cfg.redis_url is not None:
            assert cfg.region is not None
            limiter = AsyncLimiter.from_url(
                cfg.redis_url, region=cfg.region, rules=cfg.rules, prefix=cfg.key_prefix, shards=cfg.shards,
                on_error="raise", timeout=cfg.decision_timeout,
                # One Redis call at a time: the requests that arrive meanwhile share the next call, so
                # a busy proxy sends fewer, larger batches (less CPU in the proxy and in Redis).
                max_in_flight=1,
            )
            self.decider = ProxyDecider(limiter)
            try:
                await limiter.verify_rules(cfg.rules)
            except StorageError as exc:
                log.warning("proxy: cannot verify the rules against Redis now (%s); limits fail open or "
                            "closed until it answers", exc)
            except ConfigError:
                await self._close()
                raise
        else:
            assert cfg.agent_url is not None
            self.decider = ProxyDecider(AgentClient(cfg.agent_url, cfg.agent_token, cfg.decision_timeout))
            try:
                self.config = cfg = await self._agent_routes(cfg)
            except ConfigError:
                await self._close()
                raise
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=10),
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
            auto_decompress=False, skip_auto_headers=_SKIP_AUTO, trust_env=False,
        )
        self.forwarder = Forwarder(_state(cfg, self.decider), self._session, self.metrics)
        # handler_cancellation: a client that goes away cancels its upstream exchange at once.
        server = web.Server(self.forwarder, access_log=None, handler_cancellation=True,
                            keepalive_timeout=KEEPALIVE_TIMEOUT)
        runners: list[tuple[web.BaseRunner, tuple[str, int]]] = [
            (web.ServerRunner(server, handle_signals=False, shutdown_timeout=cfg.shutdown_timeout), cfg.listen)]
        if cfg.admin_listen is not None:
            runners.append((web.AppRunner(self._admin_app(), access_log=None, handle_signals=False,
                                          keepalive_timeout=KEEPALIVE_TIMEOUT),
                            cfg.admin_listen))
        cap = default_max_connections(len(runners))  # each listener's share of RLIMIT_NOFILE
        try:
            for i, (runner, (host, port)) in enumerate(runners):
                await runner.setup()
                self._runners.append(runner)
                # aiohttp's connections: a head within the fast path's HEAD_TIMEOUT, at most `cap` open
                guard = self.metrics.watch_listener(ListenerGuard(
                    "admin_listen" if i else "listen", head_timeout=lambda: HEAD_TIMEOUT, max_connections=lambda: cap))
                if i == 0 and self._fast_path():
                    self._addresses.append(await self._serve_fast(guard, guard.protocol_factory(server), host, port))
                else:
                    self._addresses.append(await listen(runner, host, port, reuse_port=self.reuse_port, guard=guard))
        except OSError as exc:
            await self._close()
            raise GeolimitError(f"proxy: cannot listen: {exc}") from exc
        self._ready = True
        self.metrics.start()
        mode = f"Redis {cfg.redis_url} as region {cfg.region}" if cfg.redis_url else f"agent {cfg.agent_url}"
        log.info("proxy listening on %s (admin: %s; upstreams: %s; decisions: %s; %d routes; %s)%s", self.url,
                 self.admin_url or "none", ", ".join(cfg.upstreams), mode, len(cfg.routes),
                 "fast path" if self._fast is not None else "aiohttp only",
                 f" as worker {self.worker_index} of {cfg.workers}" if cfg.workers > 1 else "")

    def _fast_path(self) -> bool:
        """The fast path serves the listener unless turned off or an upstream needs TLS."""
        return self.config.fast_path and all(u.startswith("http://") for u in self.config.upstreams)

    async def _serve_fast(self, guard: ListenerGuard, handoff: Callable[[], asyncio.Protocol], host: str,
                          port: int) -> tuple[str, int]:
        """The proxied listener on the fast path; ``handoff()`` (aiohttp's) gets the connections it hands off;
        ``guard``'s cap holds both."""
        assert self.forwarder is not None
        sockets = bind_sockets(host, port, reuse_port=self.reuse_port)
        address: tuple[str, int] = sockets[0].getsockname()[:2]

        def body_limit() -> int:
            max_body = self.config.max_body
            return SMALL_BODY if max_body is None else min(SMALL_BODY, max_body)

        fast = FastServer(FastForwarder(self.forwarder, UpstreamPool()), handoff, body_limit, SERVER_SOFTWARE, guard)
        self._fast = fast
        try:
            await fast.serve(sockets)
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        return address

    async def stop(self) -> None:
        """Stop accepting; in-flight requests get ``shutdown_timeout`` seconds to finish."""
        self._ready = False
        await self._close()

    async def _close(self) -> None:
        self._ready = False
        learning, self._learning = self._learning, None
        if learning is not None:
            learning.cancel()
            await asyncio.gather(learning, return_exceptions=True)
        await self.metrics.stop()
        fast, self._fast = self._fast, None
        if fast is not None:  # with the aiohttp runner, which has the connections the fast path handed off
            await asyncio.gather(fast.stop(self.config.shutdown_timeout), self._runners[0].cleanup())
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.forwarder is not None:
            self.forwarder.failures.close()  # the upstream failures still held back from the log
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.decider is not None:
            await self.decider.close()
            self.decider = None

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- reload ---------------------------------------------------------------------

    async def reload(self, config: ProxyConfig) -> str:
        """Apply a re-read configuration's routes, rules, upstreams and options.

        Validated first: in library mode, new or restructured rules are checked
        against Redis (a disagreement, or a Redis that cannot be asked, refuses the
        reload and keeps everything as it was). Settings in ``_RESTART`` are
        reported, not applied. Requests in flight finish with the old settings.
        """
        if self.forwarder is None or self.decider is None:
            raise GeolimitError("the proxy is not started")
        old = self.config
        if (config.redis_url is None) != (old.redis_url is None):
            raise ConfigError("switching between library mode (redis_url) and agent mode (agent_url) needs a restart")
        inner = self.decider.inner
        if isinstance(inner, AsyncLimiter):
            known = {r.name: r.structure for r in old.rules}
            changed = [r for r in config.rules if known.get(r.name) != r.structure]
            if changed:
                await inner.verify_rules(changed)
        else:
            config = await self._agent_routes(config)
        kept = {f.name: getattr(old, f.name) for f in fields(ProxyConfig) if f.name in _RESTART}
        restart = [name for name, value in kept.items() if getattr(config, name) != value]
        if restart:
            log.warning("proxy: changes to %s need a restart; they were not applied", ", ".join(restart))
        config = ProxyConfig(**{f.name: getattr(config, f.name) for f in fields(ProxyConfig)} | kept)
        if isinstance(inner, AsyncLimiter):
            inner.set_rules(config.rules)
        self.forwarder.state = _state(config, self.decider)
        self.config = config
        before, after = {r.name: r for r in old.rules}, {r.name: r for r in config.rules}
        summary = [f"+{n}" for n in after if n not in before] + [f"-{n}" for n in before if n not in after]
        summary += [f"~{n}" for n in after if n in before and after[n] != before[n]]
        summary.append(f"{len(config.routes)} routes")
        return " ".join(summary)

    # -- agent mode ---------------------------------------------------------------------

    async def _agent_routes(self, config: ProxyConfig) -> ProxyConfig:
        """``config`` with its limits checked against the agent's rules (a ConfigError names a route and a
        rule the agent does not decide) and its multi-rate tables expanded; unchanged while the agent has
        never answered (asked again in the background)."""
        try:
            self._agent_rules = await self._agent().rules()
        except StorageError as exc:
            if self._agent_rules is None:
                log.warning("proxy: cannot ask the agent for its rules now (%s); the routes are checked when it "
                            "answers, and until then a limit it cannot decide fails by its on_error", exc)
                if self._learning is None:
                    self._learning = asyncio.ensure_future(self._learn())
                return config
            log.warning("proxy: cannot ask the agent for its rules now (%s); checking the routes against the "
                        "rules it answered before", exc)
        return resolve_routes(config, self._agent_rules, strict=True)

    async def _learn(self) -> None:
        """Ask the agent for its rules until it answers; then check and expand the running routes."""
        while self._agent_rules is None:
            await asyncio.sleep(RETRY_INTERVAL)
            try:
                rules = await self._agent().rules()
            except StorageError:
                continue
            if self._agent_rules is not None:  # a reload asked first
                break
            self._agent_rules = rules
            log.info("proxy: the agent answered with its rules; checking the routes")
            self.config = resolve_routes(self.config, rules, strict=False)
            if self.forwarder is not None and self.decider is not None:
                self.forwarder.state = _state(self.config, self.decider)
        self._learning = None

    def _agent(self) -> AgentClient:
        inner = None if self.decider is None else self.decider.inner
        if not isinstance(inner, AgentClient):
            raise GeolimitError("the proxy is not started in agent mode")
        return inner

    # -- admin --------------------------------------------------------------------------

    def _admin_app(self) -> web.Application:
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        async def readyz(_: web.Request) -> web.Response:
            return web.Response(status=200 if self._ready else 503, content_type="application/json",
                                text=json.dumps({"ready": self._ready}))

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        return app

    # -- introspection ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxied listener's URL (``http://host:port``)."""
        if not self._addresses:
            raise GeolimitError("the proxy is not started")
        return _url(self._addresses[0])

    @property
    def admin_url(self) -> str | None:
        return _url(self._addresses[1]) if len(self._addresses) > 1 else None

    @property
    def ready(self) -> bool:
        return self._ready


def _url(address: tuple[str, int]) -> str:
    host, port = address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

"""The per-region agent: gossip with peers, serve the HTTP decision API.

Lifecycle: ``listen()`` binds the HTTP server(s) and connects Redis; ``start()``
also starts the gossip loop; ``stop()`` stops accepting, flushes the outboxes
once with a deadline and closes everything; ``abort()`` drops everything without
flushing (what a crash looks like). ``async with Agent(config)`` starts and stops.

A failed gossip round or background task is never fatal and never silent: it
is logged with its traceback, counted (``geolimit_background_task_failures``,
``/v1/status``) and retried with exponential backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.clock import Clock, micros_source
from geolimit.errors import ConfigError, GeolimitError, StorageError
from geolimit.http.connections import ListenerGuard, default_max_connections
from geolimit.http.listener import KEEPALIVE_TIMEOUT, listen
from geolimit.replication.auth import Signer, Verifier
from geolimit.replication.escrow import EscrowReplicator
from geolimit.replication.escrow_http import EscrowHttpTransport, add_escrow_routes
from geolimit.replication.gossip import GossipEngine
from geolimit.replication.replay import RedisReplayGuard
from geolimit.replication.transport import HttpTransport, Transport
from geolimit.server.admission import CheckGate
from geolimit.server.api import add_api_routes, add_health_routes
from geolimit.server.config import AgentConfig
from geolimit.server.config_reload import applied_on_reload, needs_restart, rule_changes
from geolimit.server.gossip_http import add_gossip_routes
from geolimit.server.metrics import AgentMetrics
from geolimit.server.replicators import escrow_replicator, gossip_engine, gossip_transport
from geolimit.server.round_loop import RoundLoop
from geolimit.server.status import agent_status
from geolimit.server.workers import WorkerSigner, owned_shards

if TYPE_CHECKING:
    from geolimit.server.rls.server import RlsServer

__all__ = ["Agent"]

#: Seconds a stopping agent waits for the HTTP requests in progress.
STOP_GRACE = 3.0
log = logging.getLogger("geolimit.agent")


class Agent:
    """One region's replication agent and HTTP API."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock: Clock | None = None,
        transport: Transport | None = None,
        worker_index: int = 0,
    ) -> None:
        self.config = config
        self._clock: Callable[[], float] = clock or time.time
        self._decision_clock = clock
        # Worker ``worker_index`` of ``config.workers`` (geolimit/server/workers.py): owns shards s % N == i.
        self.worker_index = worker_index
        self.owned = owned_shards(config.shards, worker_index, config.workers)
        self.signer = Signer(config.secret, config.region, self._clock) if config.workers == 1 else \
            WorkerSigner(config.secret, config.region, self._clock, index=worker_index, workers=config.workers)
        self.verifier = Verifier(config.secret, [p.name for p in config.peers], config.region, config.auth_window,
                                 self._clock)
        self._transport = transport
        self.limiter: AsyncLimiter | None = None
        self.engine: GossipEngine | None = None
        self.escrow: EscrowReplicator | None = None  # escrow rules' rebalancing and replication
        self._redis_ok = False
        self._last_redis_error: str | None = None
        # Several workers: each /metrics scrape describes them all (geolimit/worker_metrics.py).
        self.metrics = AgentMetrics(lambda: self.engine, self._clock, worker=worker_index, workers=config.workers,
                                    redis_unreachable=lambda: not self._redis_ok and self._last_redis_error is not None)
        # The bound on checks in progress: beyond it, 503 at once (geolimit/server/admission.py).
        self.checks = CheckGate(lambda: self.config.max_checks_in_progress, self.metrics.checks_shed.inc)
        self.metrics.checks_in_progress.set_function(lambda: self.checks.in_progress)
        self._runners: list[web.AppRunner] = []
        self._addresses: list[tuple[str, int]] = []
        self._rounds = RoundLoop(lambda: self.config, lambda: self._round())  # the gossip loop (round_loop.py)
        self._started = self._listening = False
        self.rls: RlsServer | None = None  # the Envoy rate limit service, when rls_listen is set
        self._rls_address: tuple[str, int] | None = None

    # -- lifecycle ------------------------------------------------------------

    async def listen(self) -> None:
        """Connect Redis and bind the HTTP server(s); gossip does not run yet."""
        if self._listening:
            return
        cfg = self.config
        self.limiter = AsyncLimiter.from_url(
            cfg.redis_url, region=cfg.region, rules=cfg.rules, prefix=cfg.key_prefix, shards=cfg.shards,
            on_error=cfg.on_error,  # type: ignore[arg-type]
            clock=self._decision_clock,
            # Decisions honour it; replication scripts do bounded work, well within it.
            timeout=cfg.redis_timeout,
        )
        try:  # another region's Redis, or rules it holds with other windows: refused now
            await self.limiter.verify_rules(cfg.rules)
        except StorageError as exc:  # Redis down: decisions fail open or closed until it answers
            log.warning("agent %s: cannot check the rules and region against Redis now (%s)", cfg.region, exc)
        except ConfigError:
            await self._close()
            raise
        self.verifier.guard = RedisReplayGuard(self.limiter.store, cfg.key_prefix, cfg.region, cfg.auth_window)
        if self._transport is None:
            self._transport = gossip_transport(cfg, self.signer, self.verifier)
        self.engine = gossip_engine(
            cfg, self.limiter, self._transport, owned=self.owned, decision_clock=self._decision_clock,
            clock=self._clock,
            anti_entropy=self.worker_index == 0,  # one initiator per region; every worker serves exchanges
            worker=self.worker_index,
        )
        self.escrow = escrow_replicator(cfg, self.limiter, self.signer, self.verifier, owned=self.owned,
                                        decision_clock=self._decision_clock, clock=self._clock)
        gossip_app = web.Application(client_max_size=cfg.max_message_bytes + 1)
        add_gossip_routes(gossip_app, self)
        add_escrow_routes(gossip_app, self)
        add_health_routes(gossip_app, self)
        apps = [("listen", gossip_app, cfg.listen, cfg.tls.server_context() if cfg.tls else None)]
        if cfg.api_listen is None:
            add_api_routes(gossip_app, self)
        else:
            api_app = web.Application()
            add_api_routes(api_app, self)
            add_health_routes(api_app, self)
            apps.append(("api_listen", api_app, cfg.api_listen, None))
        cap = default_max_connections(len(apps) + (cfg.rls_listen is not None))  # each listener's share of RLIMIT_NOFILE
        try:
            for label, app, (host, port), ssl_ctx in apps:
                # A stop waits this long for requests in progress (aiohttp's default: 60 s); a peer
                # whose message is cut off keeps it queued and sends it again.
                runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=STOP_GRACE,
                                       keepalive_timeout=KEEPALIVE_TIMEOUT)
                await runner.setup()
                self._runners.append(runner)
                guard = self.metrics.watch_listener(ListenerGuard(  # a reload applies both
                    label, head_timeout=lambda: self.config.head_timeout,
                    max_connections=lambda: self.config.max_connections or cap))
                self._addresses.append(await listen(runner, host, port, ssl_context=ssl_ctx, guard=guard,
                                                    reuse_port=cfg.workers > 1))  # the workers share the port
            if cfg.rls_listen is not None:
                await self._start_rls(cfg.rls_listen, self.metrics.watch_listener(ListenerGuard(
                    "rls_listen", max_connections=lambda: self.config.max_connections or cap)))
        except OSError as exc:
            await self._close()
            raise GeolimitError(f"agent {cfg.region}: cannot listen: {exc}") from exc
        except GeolimitError:
            await self._close()
            raise
        self._listening = True
        log.info("agent %s listening on %s (peers: %s)%s", cfg.region, self.url,
                 ", ".join(p.name for p in cfg.peers) or "none",
                 f" as worker {self.worker_index} of {cfg.workers}" if cfg.workers > 1 else "")

    @property
    def max_message_bytes(self) -> int:
        return self.config.max_message_bytes

    @property
    def body_timeout(self) -> float:
        return self.config.timeout

    async def _start_rls(self, address: tuple[str, int], guard: ListenerGuard) -> None:
        from geolimit.server.rls.server import RlsServer  # grpcio and xds-protos: the rls extra

        if self.rls is None:  # once per agent: it owns metrics in the agent's registry
            self.rls = RlsServer(self, micros_source(self._decision_clock) or (lambda: None))
        self._rls_address = await self.rls.start(address, reuse_port=self.config.workers > 1, guard=guard)

    async def start(self) -> None:
        """Listen (if not yet) and start the gossip loop."""
        await self.listen()
        if self._started:
            return
        self._started = True
        self._rounds.start()
        self.metrics.start()

    async def stop(self, flush_timeout: float = 2.0) -> bool:
        """Graceful stop; returns True if every outbox was delivered before the deadline."""
        if self.rls is not None:
            try:
                await self.rls.stop()
            except BaseException:  # its poller crashed: the rest still stops, then the error is raised
                await self.abort()
                raise
        for runner in self._runners:
            for site in list(runner.sites):
                await site.stop()
        await self._rounds.cancel()
        flushed = True
        if self.engine is not None and self._listening:
            try:
                flushed = await self.engine.flush(self._clock() + flush_timeout)
            except (GeolimitError, OSError) as exc:
                log.warning("agent %s: final flush failed: %s", self.config.region, exc)
                flushed = False
        await self._close()
        return flushed

    async def abort(self) -> None:
        """Drop everything without flushing, as a crash would."""
        await self._rounds.cancel()
        await self._close()

    async def wait(self) -> None:
        """Until the gossip loop ends; raises if it crashed."""
        await self._rounds.wait()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _close(self) -> None:
        await self.metrics.stop()
        try:
            if self.rls is not None:
                await self.rls.stop(None)
        finally:
            await self._close_listeners_and_stores()

    async def _close_listeners_and_stores(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.engine is not None:
            await self.engine.cancel()
            await self.engine.close()
        if self.escrow is not None:
            await self.escrow.close()
        if self._transport is not None:
            await self._transport.close()
        if self.limiter is not None:
            await self.limiter.aclose()
        self._listening = self._started = False

    # -- gossip loop ----------------------------------------------------------

    async def step(self) -> None:
        """One round, then wait for its sends and anti-entropy (tests and tools)."""
        assert self.engine is not None, "listen() first"
        await self._round()
        await self.engine.settle()
        if self.escrow is not None:
            await self.escrow.settle()

    async def _round(self) -> None:
        assert self.engine is not None
        started = time.perf_counter()
        try:
            await self.engine.round()
            if self.escrow is not None:
                await self.escrow.round()
                if self.escrow.rules and self.limiter is not None:  # the agent's own limiter (/v1/check)
                    self.limiter.use_escrow_regions(self.escrow.regions, self.escrow.wait_us())
        except StorageError as exc:
            if self._redis_ok or self._last_redis_error is None:
                log.warning("agent %s: Redis unavailable: %s", self.config.region, exc)
            self._redis_ok = False
            self._last_redis_error = str(exc)
        else:
            if not self._redis_ok and self._last_redis_error is not None:
                log.info("agent %s: Redis reachable again", self.config.region)
            self._redis_ok = True
        self.metrics.round_seconds.observe(time.perf_counter() - started)

    async def reload(self, config: AgentConfig) -> str:
        """Apply a re-read configuration's rules (limits, policies, new and removed rules).

        Everything is validated before anything changes: a rule whose window or
        resolution disagrees with what this Redis already holds is refused (its keys
        would be misread). Settings that need a restart (listen addresses, peers,
        secret, Redis URL) are reported, not applied.
        """
        limiter = self.require_limiter()
        if self.engine is None:
            raise GeolimitError("agent is not started")
        await limiter.verify_rules(config.rules)
        old = self.config
        limiter.set_rules(config.rules)
        self.engine.set_rules(limiter.rules)
        if self.escrow is not None:
            self.escrow.set_rules(limiter.rules)
        restart = needs_restart(old, config)
        if restart:
            log.warning("agent %s: changes to %s need a restart; they were not applied", old.region, ", ".join(restart))
        summary = rule_changes(old, config)
        self.config = applied_on_reload(old, config)
        return summary

    # -- introspection --------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._addresses[0]
        scheme = "https" if self.config.tls and self.config.tls.cert_file else "http"
        return f"{scheme}://{host}:{port}"

    @property
    def api_url(self) -> str:
        if len(self._addresses) < 2:
            return self.url
        host, port = self._addresses[1]
        return f"http://{host}:{port}"

    @property
    def rls_address(self) -> tuple[str, int]:
        """Where the Envoy rate limit service listens (``[region] rls_listen``)."""
        if self._rls_address is None:
            raise GeolimitError("the rate limit service is not listening (set [region] rls_listen)")
        return self._rls_address

    def require_limiter(self) -> AsyncLimiter:
        if self.limiter is None:
            raise StorageError("agent is not started")
        return self.limiter

    def set_peer_url(self, name: str, url: str) -> None:
        """Point gossip for ``name`` at ``url`` (for agents started on port 0)."""
        if isinstance(self._transport, HttpTransport):
            self._transport.set_url(name, url)
        if self.escrow is not None and isinstance(self.escrow.transport, EscrowHttpTransport):
            self.escrow.transport.set_url(name, url)

    def failure(self) -> str | None:
        """A fatal failure (the gossip loop itself died), or None."""
        return self._rounds.crashed

    def background_failures(self) -> dict[str, Any]:
        """Failed rounds and tasks so far (each was retried) and the last error."""
        tasks = self.engine.task_failures if self.engine is not None else 0
        last = self.engine.last_task_error if self.engine is not None else None
        return {"rounds": self._rounds.failures, "tasks": tasks, "last_round_error": self._rounds.last_failure,
                "last_task_error": last}

    def readiness(self) -> tuple[bool, list[str]]:
        waiting = []
        if not self._redis_ok:
            waiting.append(f"redis ({self._last_redis_error or 'no round yet'})")
        if self.engine is None or not self.engine.initial_sync_done:
            waiting.append("first anti-entropy with every peer")
        if self.failure():
            waiting.append("gossip loop crashed")
        return not waiting, waiting

    def status(self) -> dict[str, Any]:
        """What ``/v1/status`` answers (geolimit/server/status.py)."""
        return agent_status(self, self._clock())

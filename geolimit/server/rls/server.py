"""The agent's gRPC listener: ``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit``.

Served by :class:`~geolimit.server.rls.h2c.FastServer` (HTTP/2 cleartext on
asyncio Protocols, ``[region] rls_fast_path = true``, the default) or by
:class:`~geolimit.server.rls.transport.UnaryServer` (grpcio's core, a poller
thread, the handler in the agent's event loop); the message classes are Envoy's own API
definitions as compiled by the gRPC project (the ``xds-protos`` package). Each
request is planned by :mod:`geolimit.server.rls.decide` and decided in Redis by
:class:`~geolimit.server.rls.executor.Executor`, with a callback on its future
rather than a task per request.

Errors: a request without a domain or descriptors, or with too many, or that
does not parse, is ``INVALID_ARGUMENT``. When Redis cannot be reached the agent's ``on_error``
decides: ``raise`` answers ``UNAVAILABLE`` (Envoy's ``failure_mode_deny`` then
decides), ``allow`` answers OK and ``deny`` OVER_LIMIT for every enforced limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Histogram

from geolimit.errors import GeolimitError, RequestError, StorageError
from geolimit.http.connections import ListenerGuard, default_max_connections
from geolimit.server.rls.decide import Answer, Descriptor, Transaction, answer, degraded, plan
from geolimit.server.rls.encode import encode_response
from geolimit.server.rls.executor import Executor
from geolimit.server.rls.h2c import FastServer
from geolimit.server.rls.transport import StatusCode, UnaryServer
from geolimit.store.protocol import RulePlan

if TYPE_CHECKING:
    from geolimit.core.decision import Decision
    from geolimit.server.agent import Agent

__all__ = ["SERVICE", "RlsServer"]

log = logging.getLogger("geolimit.agent")

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
METHOD = f"/{SERVICE}/ShouldRateLimit"
_MAX_WARNED_DOMAINS = 100
#: geolimit_rls_decisions label sets (domain, key, result) before new ones count under OTHER_SERIES.
MAX_SERIES = 10_000
#: The domain and key labels of requests for a domain the configuration does not name.
UNKNOWN_DOMAIN = "_unknown"
#: The key label of descriptors past MAX_SERIES label sets.
OTHER_SERIES = "_other"


class Call(Protocol):
    """A call of either transport: its request message, answered once."""

    request: bytes

    def reply(self, message: bytes) -> None: ...

    def fail(self, code: Any, details: str) -> None: ...


class RlsServer:
    """Serves ShouldRateLimit for one agent; reads the agent's configuration on every call (reloads apply)."""

    def __init__(self, agent: Agent, now_us: Callable[[], int | None]) -> None:
        self._agent = agent
        self._now_us = now_us
        self._server: UnaryServer | FastServer | None = None
        self._executor: Executor | None = None
        self._plans: dict[str, RulePlan] = {}
        self._unknown: set[str] = set()
        self._counted: dict[tuple[str, str, str], Any] = {}  # labels -> the counter's child
        registry = agent.metrics.registry
        self.decisions = Counter(
            "geolimit_rls_decisions", "Rate limit service descriptors by domain, limit and result "
            "(ok, over_limit, shadow_over_limit, unlimited, no_limit)", ["domain", "key", "result"], registry=registry,
        )
        self.request_seconds = Histogram(
            "geolimit_rls_request_seconds", "ShouldRateLimit latency (including Redis)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=registry,
        )
        self.request_timeouts = Counter(
            "geolimit_rls_request_timeouts", "Rate limit service requests whose stream had not ended "
            "region.rls_request_timeout after their HEADERS: answered DEADLINE_EXCEEDED and reset "
            "(the HTTP/2 fast path)", registry=registry,
        )
        self.idle_closed = Counter(
            "geolimit_rls_idle_connections_closed", "Rate limit service connections closed with GOAWAY(NO_ERROR) "
            "after region.rls_idle_timeout with no open stream and no frame received (the HTTP/2 fast path)",
            registry=registry,
        )

    async def start(self, address: tuple[str, int], reuse_port: bool = False,
                    guard: ListenerGuard | None = None) -> tuple[str, int]:
        """Bind ``address`` and serve; returns the bound ``(host, port)``. ``guard``: the fast path's
        cap on open connections (grpcio's core has its own handling)."""
        host, port = address
        limiter = self._agent.require_limiter()
        self._executor = Executor(limiter, self._agent.config.region.encode(), self._now_us)
        region = self._agent.config.region
        # Without SO_REUSEPORT a port in use is an error, not a silently shared port.
        server: UnaryServer | FastServer
        try:
            if self._agent.config.rls_fast_path:
                server = FastServer(METHOD, self._received, timed_out=self.request_timeouts.inc,
                                    request_timeout=lambda: self._agent.config.rls_request_timeout, guard=guard,
                                    idle_timeout=lambda: self._agent.config.rls_idle_timeout,
                                    idle_closed=self.idle_closed.inc)
                bound = await server.listen(host, port, reuse_port)
            else:
                # grpcio's core closes the connections past this at their accept (read once, at start).
                cap = guard.max_connections() if guard is not None else default_max_connections()
                server = UnaryServer(METHOD, self._received, options=[("grpc.so_reuseport", 1 if reuse_port else 0),
                                                                      ("grpc.max_allowed_incoming_connections", cap)])
                bound = server.bind(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
                await server.start()
        except GeolimitError as exc:
            raise GeolimitError(f"agent {region}: {exc}") from exc
        self._server = server
        transport = "HTTP/2 fast path" if isinstance(server, FastServer) else "grpcio"
        log.info("agent %s: rate limit service (Envoy RLS v3) on %s:%d (%s)", region, host, bound, transport)
        return host, bound

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting; in-flight calls get ``grace`` seconds to finish."""
        server, self._server = self._server, None
        try:
            if server is not None:
                await server.stop(grace)
        finally:
            if self._executor is not None:
                await self._executor.wait()

    def _received(self, call: Call) -> None:
        """A ShouldRateLimit call (in the event loop): answered now, or when its decisions are in."""
        started = time.perf_counter()
        gate = self._agent.checks  # the bound of /v1/check too: one event loop decides both
        if gate.full():  # overloaded: UNAVAILABLE at once, so Envoy's failure_mode_deny decides
            gate.refuse()
            call.fail(StatusCode.UNAVAILABLE, f"overloaded: the agent has {gate.in_progress} checks in progress "
                                              f"(region.max_checks_in_progress {gate.bound})")
            return
        try:
            try:
                request = rls_pb2.RateLimitRequest.FromString(call.request)
            except DecodeError as exc:
                raise RequestError(f"not a RateLimitRequest: {exc}") from exc
            name, tx, decisions, on_error = self._plan(request)
        except BaseException as exc:
            _fail(call, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if decisions is None:
            self._answer(call, name, answer(tx, []), started)
        else:
            gate.enter(1)  # a call counts one check, whatever its descriptors (not full: checked above)
            decisions.add_done_callback(lambda done: self._decided(call, name, tx, done, on_error, started))

    def _decided(self, call: Call, name: str, tx: Transaction, done: asyncio.Future[list[Decision]],
                 on_error: str, started: float) -> None:
        self._agent.checks.leave(1)
        try:
            try:
                result = answer(tx, done.result())
            except StorageError:
                if on_error == "raise":
                    raise
                result = degraded(tx, on_error == "allow")
            self._answer(call, name, result, started)
        except BaseException as exc:
            _fail(call, exc)
            if not isinstance(exc, Exception):
                raise

    def _answer(self, call: Call, name: str, result: Answer, started: float) -> None:
        rls = self._agent.config.rls
        known = rls is not None and name in rls.domains
        for status in result.statuses:
            # Label values come from the request: an unknown domain counts as one, and past
            # MAX_SERIES label sets (descriptor keys, detailed_metric values) new ones count
            # under "_other", or anyone reaching the port grows /metrics without bound.
            labels = (name, status.metric, status.result) if known else (UNKNOWN_DOMAIN, UNKNOWN_DOMAIN, status.result)
            child = self._counted.get(labels)
            if child is None:
                if len(self._counted) >= MAX_SERIES:
                    labels = (labels[0], OTHER_SERIES, status.result)
                    child = self._counted.get(labels)
                if child is None:
                    child = self._counted[labels] = self.decisions.labels(*labels)
            child.inc()
        call.reply(encode_response(result))
        self.request_seconds.observe(time.perf_counter() - started)

    def _plan(self, request: Any) -> tuple[str, Transaction, asyncio.Future[list[Decision]] | None, str]:
        """The domain's name, the transaction, its decisions to come (None: none needed) and ``on_error``."""
        name: str = request.domain
        if not name:
            raise RequestError("rate limit domain must not be empty")
        base = request.hits_addend or 1  # unset (0) counts 1, as Envoy documents
        descriptors = [
            Descriptor(tuple([(e.key, e.value) for e in d.entries]),  # a list: faster than a generator
                       d.hits_addend.value if d.HasField("hits_addend") else base)
            for d in request.descriptors
        ]
        config = self._agent.config
        domain = config.rls.domains.get(name) if config.rls is not None else None
        if domain is None:
            self._warn_unknown(name)
        tx = plan(domain, name, descriptors, self._agent.require_limiter().layout, self._plans)
        if not tx.requests:
            return name, tx, None, config.on_error
        if self._executor is None:
            raise GeolimitError("the rate limit service is not started")
        return name, tx, self._executor.decide(tx), config.on_error

    def _warn_unknown(self, name: str) -> None:
        if name not in self._unknown and len(self._unknown) < _MAX_WARNED_DOMAINS:
            self._unknown.add(name)
            shown = name if len(name) <= 100 else name[:100] + f"... ({len(name)} characters)"
            log.warning("rate limit service: no configuration for domain %r: its descriptors get no limit", shown)


def _fail(call: Call, exc: BaseException) -> None:
    """Answers ``call`` with the status for ``exc``."""
    if isinstance(exc, RequestError):
        call.fail(StatusCode.INVALID_ARGUMENT, str(exc))
    elif isinstance(exc, StorageError):
        call.fail(StatusCode.UNAVAILABLE, str(exc))
    elif isinstance(exc, GeolimitError):
        log.error("ShouldRateLimit failed: %s", exc)
        call.fail(StatusCode.INTERNAL, str(exc))
    else:
        log.error("ShouldRateLimit crashed", exc_info=exc)
        call.fail(StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

"""The agent's gRPC listener: ``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit``.

A ``grpc.aio`` server in the agent's event loop; the message classes and the
service registration are Envoy's own API definitions as compiled by the gRPC
project (the ``xds-protos`` package). Each request is planned by
:mod:`geolimit.server.rls.decide` and decided in Redis by
:class:`~geolimit.server.rls.executor.Executor`.

Errors: a request without a domain or descriptors, or with too many, is
``INVALID_ARGUMENT``. When Redis cannot be reached the agent's ``on_error``
decides: ``raise`` answers ``UNAVAILABLE`` (Envoy's ``failure_mode_deny`` then
decides), ``allow`` answers OK and ``deny`` OVER_LIMIT for every enforced limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import Counter, Histogram

from geolimit.errors import GeolimitError, RequestError, StorageError
from geolimit.server.rls.decide import Answer, Descriptor, answer, degraded, plan
from geolimit.server.rls.descriptors import UNIT_CODES
from geolimit.server.rls.executor import Executor
from geolimit.store.protocol import RulePlan

if TYPE_CHECKING:
    from geolimit.server.agent import Agent

__all__ = ["SERVICE", "RlsServer"]

log = logging.getLogger("geolimit.agent")

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
_OK = rls_pb2.RateLimitResponse.OK
_OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
_MAX_WARNED_DOMAINS = 100


class RlsServer:
    """Serves ShouldRateLimit for one agent; reads the agent's configuration on every call (reloads apply)."""

    def __init__(self, agent: Agent, now_us: Callable[[], int | None]) -> None:
        self._agent = agent
        self._now_us = now_us
        self._server: grpc.aio.Server | None = None
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

    async def start(self, address: tuple[str, int], reuse_port: bool = False) -> tuple[str, int]:
        """Bind ``address`` and serve; returns the bound ``(host, port)``."""
        host, port = address
        limiter = self._agent.require_limiter()
        self._executor = Executor(limiter, self._agent.config.region.encode(), self._now_us)
        # Without SO_REUSEPORT a port in use is an error, not a silently shared port.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self, server)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError as exc:
            await server.stop(None)
            raise GeolimitError(f"agent {self._agent.config.region}: cannot listen for gRPC on {target}: {exc}") from exc
        await server.start()
        self._server = server
        log.info("agent %s: rate limit service (Envoy RLS v3) on %s:%d", self._agent.config.region, host, bound)
        return host, bound

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting; in-flight calls get ``grace`` seconds to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        if self._executor is not None:
            await self._executor.wait()

    async def ShouldRateLimit(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The RPC (its name is the service's)."""
        started = time.perf_counter()
        try:
            result = await self._decide(request)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StorageError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except GeolimitError as exc:
            log.error("ShouldRateLimit failed: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except Exception as exc:
            log.exception("ShouldRateLimit crashed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        self.request_seconds.observe(time.perf_counter() - started)
        return result

    async def _decide(self, request: Any) -> Any:
        name: str = request.domain
        if not name:
            raise RequestError("rate limit domain must not be empty")
        base = request.hits_addend or 1  # unset (0) counts 1, as Envoy documents
        descriptors = [
            Descriptor(tuple((e.key, e.value) for e in d.entries),
                       d.hits_addend.value if d.HasField("hits_addend") else base)
            for d in request.descriptors
        ]
        config = self._agent.config
        domain = config.rls.domains.get(name) if config.rls is not None else None
        if domain is None:
            self._warn_unknown(name)
        tx = plan(domain, name, descriptors, self._agent.require_limiter().layout, self._plans)
        if not tx.requests:
            result = answer(tx, [])
        else:
            assert self._executor is not None, "start() first"
            try:
                result = answer(tx, await self._executor.decide(tx))
            except StorageError:
                if config.on_error == "raise":
                    raise
                result = degraded(tx, config.on_error == "allow")
        for status in result.statuses:
            labels = (name, status.metric, status.result)
            child = self._counted.get(labels)
            if child is None:
                child = self._counted[labels] = self.decisions.labels(*labels)
            child.inc()
        return _response(result)

    def _warn_unknown(self, name: str) -> None:
        if name not in self._unknown and len(self._unknown) < _MAX_WARNED_DOMAINS:
            self._unknown.add(name)
            log.warning("rate limit service: no configuration for domain %r: its descriptors get no limit", name)


def _response(result: Answer) -> Any:
    response = rls_pb2.RateLimitResponse(overall_code=_OVER_LIMIT if result.over_limit else _OK)
    for s in result.statuses:
        status = response.statuses.add(code=_OVER_LIMIT if s.over_limit else _OK, limit_remaining=s.remaining)
        if s.limit is not None and s.limit.rule is not None:
            current = status.current_limit
            current.name = s.limit.rule.name
            current.requests_per_unit = s.limit.requests_per_unit
            current.unit = UNIT_CODES[s.limit.unit]
        if s.reset_after is not None:
            micros = round(s.reset_after * 1e6)
            status.duration_until_reset.seconds = micros // 1_000_000
            status.duration_until_reset.nanos = micros % 1_000_000 * 1000
    for key, value in result.headers:
        response.response_headers_to_add.add(key=key, value=value)
    return response

"""Deciding HTTP requests: routes, limits, shadow mode and failure policy.

The reverse proxy and the ASGI/aiohttp middlewares all use a :class:`Guard`::

    guard = Guard(limiter, [RoutePolicy(Route("/search"), (LimitSpec("api", KeySpec("ip")),))])
    verdict = await guard.check(RequestInfo("GET", "/search", headers, peer="203.0.113.9"))
    if not verdict.allowed: ...  # 429 with verdict.headers() and problem_body(verdict.decision)

The first route that matches decides. Each of its limits names a rule, a key and
a cost. Limits are decided one after the other (each atomically in Redis); a
request is let through only if every enforced limit allows it. A *shadow* limit
counts and reports but never denies. When Redis (or the agent) cannot be reached,
each limit fails open or closed as configured, and the verdict is marked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.errors import StorageError
from geolimit.http.headers import rate_limit_headers
from geolimit.http.keys import CostSpec, KeySpec, Network, RequestInfo, Route, trusted_networks

__all__ = ["Decider", "Guard", "LimitSpec", "RoutePolicy", "Verdict"]

log = logging.getLogger("geolimit.http")


class Decider(Protocol):
    """An :class:`~geolimit.AsyncLimiter`, or a client of the local agent."""

    async def hit(self, rules: str, subject: str | bytes, cost: int = 1) -> Decision: ...


@dataclass(frozen=True)
class LimitSpec:
    rule: str
    key: KeySpec = field(default_factory=lambda: KeySpec("ip"))
    cost: CostSpec = field(default_factory=CostSpec)
    shadow: bool = False
    on_error: Literal["allow", "deny"] = "allow"


@dataclass(frozen=True)
class RoutePolicy:
    route: Route
    limits: tuple[LimitSpec, ...]


@dataclass
class Verdict:
    allowed: bool
    decision: Decision | None = None  # every rule's result combined (None: no route matched)
    denied_by: list[str] = field(default_factory=list)  # enforced rules that denied
    shadow_denied: list[str] = field(default_factory=list)  # shadow rules that would have denied
    failed: list[str] = field(default_factory=list)  # rules decided by on_error (storage down)
    bad_request: str | None = None  # the cost could not be read from the request

    def headers(self, legacy: bool = False) -> list[tuple[str, str]]:
        return [] if self.decision is None else rate_limit_headers(self.decision, legacy=legacy)


class Guard:
    """Decides requests against route policies."""

    def __init__(
        self,
        decider: Decider,
        policies: Sequence[RoutePolicy],
        trusted_proxies: Sequence[str] = (),
    ) -> None:
        self.decider = decider
        self.policies = tuple(policies)
        self.trusted: tuple[Network, ...] = trusted_networks(trusted_proxies)
        self._last_error_log = 0.0
        self.counters: dict[tuple[str, str], int] = {}  # (rule, outcome) -> count

    def match(self, request: RequestInfo) -> tuple[RoutePolicy, dict[str, str]] | None:
        for policy in self.policies:
            params = policy.route.match(request.method, request.path)
            if params is not None:
                return policy, params
        return None

    def _count(self, rule: str, outcome: str) -> None:
        self.counters[(rule, outcome)] = self.counters.get((rule, outcome), 0) + 1

    async def check(self, request: RequestInfo) -> Verdict:
        found = self.match(request)
        if found is None:
            return Verdict(True)
        policy, params = found
        verdict = Verdict(True)
        results: list[RuleDecision] = []
        for limit in policy.limits:
            subject = limit.key.subject(request, params, policy.route.template, self.trusted)
            try:
                cost = limit.cost.cost(request)
            except ValueError as exc:
                verdict.allowed = False
                verdict.bad_request = f"cannot read the cost of rule {limit.rule!r}: {exc}"
                return verdict
            try:
                decision = await self.decider.hit(limit.rule, subject, cost)
            except StorageError as exc:
                self._storage_failed(limit, exc)
                verdict.failed.append(limit.rule)
                self._count(limit.rule, f"error_{limit.on_error}")
                if limit.on_error == "deny" and not limit.shadow:
                    verdict.allowed = False
                    verdict.denied_by.append(limit.rule)
                continue
            results.extend(decision.results)
            if decision.allowed:
                self._count(limit.rule, "allowed")
            elif limit.shadow:
                verdict.shadow_denied.append(limit.rule)
                self._count(limit.rule, "shadow_denied")
                log.info("shadow limit %s would deny %s %s for %s", limit.rule, request.method, request.path, subject)
            else:
                verdict.allowed = False
                verdict.denied_by.append(limit.rule)
                self._count(limit.rule, "denied")
        if results:
            enforced = [r for r in results if r.rule not in verdict.shadow_denied]
            shown = combine(enforced or results)
            verdict.decision = shown
        return verdict

    def _storage_failed(self, limit: LimitSpec, exc: StorageError) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10.0:
            self._last_error_log = now
            log.warning("rate limit storage unavailable; rule %s fails %s: %s",
                        limit.rule, "open" if limit.on_error == "allow" else "closed", exc)

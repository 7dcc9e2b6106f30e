"""Deciding HTTP requests: routes, limits, shadow mode and failure policy.

The reverse proxy and the ASGI/aiohttp middlewares all use a :class:`Guard`::

    guard = Guard(limiter, [RoutePolicy(Route("/search"), (LimitSpec("api", KeySpec("ip")),))])
    verdict = await guard.check(RequestInfo("GET", "/search", headers, peer="203.0.113.9"))
    if not verdict.allowed: ...  # 429 with verdict.headers() and problem_body(verdict.decision)

The first route that matches decides. Each of its limits names a rule, a key and
a cost. A route's enforced limits are decided all-or-nothing, as the library's
``hit`` on several rules: a request denied by one limit consumes none of them.
Limits that share a key and a cost are decided in one atomic call. When they do
not (``api`` per address and ``bandwidth`` per body byte), every group is first
peeked, and consumed only if all allow; a concurrent request can slip between
the peek and the hits, and then a denied request may still consume the groups
decided before the race showed. A rule the decider cannot decide (one the agent
does not know) fails on its own, by its ``on_error``; its group-mates are then
decided without it. A name the decider decides as several rules (an agent's
multi-rate table ``api``: ``api.1h`` and ``api.1m``) shows all of them.

A *shadow* limit never denies and never shows in the response headers: it is
decided after the enforced limits, and counts the requests they admit (what it
would count if it were enforced). When Redis (or the agent) cannot be reached,
each limit fails open or closed as configured, and the verdict is marked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.errors import RequestError, StorageError
from geolimit.http.headers import QuotaUnit
from geolimit.http.keys import Network, RequestInfo, trusted_networks
from geolimit.http.plan import (
    _ONE_REQUEST,
    Decider,
    LimitSpec,
    OneCall,
    RoutePolicy,
    Verdict,
    _allowed,
    _attribute,
    _Call,
    _groups,
    _Planned,
    _split_misconfigured,
)
from geolimit.log_every import LogEvery

__all__ = ["Decider", "Guard", "LimitSpec", "OneCall", "RoutePolicy", "Verdict"]

log = logging.getLogger("geolimit.http")

_MATCH_CACHE = 1024  # (method, path) pairs whose match Guard.match keeps (all forgotten when full)
_MATCH_CACHED_PATH = 1024  # longer paths are matched every time


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
        self.storage_lines = LogEvery(log)  # one line per 10 s of each kind, counting the others
        self.attribution_lines = LogEvery(log, level=logging.ERROR)
        self.counters: dict[tuple[str, str], int] = {}  # (rule, outcome) -> count
        #: The policies one hit decides (id() -> plan): see :meth:`one_call`.
        self._one_call: dict[int, OneCall] = {}
        self._matched: dict[tuple[str, str], tuple[RoutePolicy, dict[str, str]] | None] = {}  # see match()
        for policy in self.policies:
            one = OneCall.of(policy)
            if one is not None:
                self._one_call[id(policy)] = one

    def one_call(self, policy: RoutePolicy) -> OneCall | None:
        """The plan of ``policy`` if one ``hit`` decides it (see :class:`OneCall`), else None."""
        return self._one_call.get(id(policy))

    async def check_one(self, one: OneCall, request: RequestInfo, params: Mapping[str, str]) -> Decision | Verdict:
        """:meth:`check` of a request that matched ``one.policy`` (with ``params``): its Decision when every
        limit allows (the counters updated), else the Verdict that :meth:`check` returns."""
        subject = one.key.subject(request, params, one.policy.route.template, self.trusted)
        try:
            rules = one.rules
            outcome: Decision | StorageError = await self.decider.hit(
                rules if type(rules) is str else list(rules), subject, one.cost)
        except StorageError as exc:
            outcome = exc
        if type(outcome) is Decision and len(outcome.results) == len(one.names) and all(
                [r.allowed for r in outcome.results]):
            counters = self.counters
            for key in one.counted:
                counters[key] = counters.get(key, 0) + 1
            return outcome
        planned = [_Planned(limit, subject, one.cost, unit) for limit, unit in
                   zip(one.policy.limits, one.units, strict=True)]
        verdict = Verdict(True)
        shown = await self._settle([planned], [outcome], verdict)
        if shown:
            verdict.decision = combine([r for r, _ in shown])
            verdict.units = tuple([u for _, u in shown])
        return verdict

    def match(self, request: RequestInfo) -> tuple[RoutePolicy, dict[str, str]] | None:
        """The first policy whose route matches, with the route's parameters (kept by method and path:
        the same answer, parameters included, for the next request of that path; do not change them)."""
        key = (request.method, request.path)
        try:
            return self._matched[key]
        except KeyError:
            pass
        found = None
        for policy in self.policies:
            params = policy.route.match(request.method, request.path)
            if params is not None:
                found = policy, params
                break
        if len(request.path) <= _MATCH_CACHED_PATH:
            if len(self._matched) >= _MATCH_CACHE:
                self._matched.clear()
            self._matched[key] = found
        return found

    def _count(self, rule: str, outcome: str) -> None:
        self.counters[(rule, outcome)] = self.counters.get((rule, outcome), 0) + 1

    async def check(self, request: RequestInfo) -> Verdict:
        found = self.match(request)
        if found is None:
            return Verdict(True)
        policy, params = found
        one = self._one_call.get(id(policy))
        if one is not None:
            outcome = await self.check_one(one, request, params)
            return outcome if isinstance(outcome, Verdict) else _allowed(outcome, one)
        planned: list[_Planned] = []
        shadows: list[_Planned] = []
        for limit in policy.limits:
            subject = limit.key.subject(request, params, policy.route.template, self.trusted)
            try:
                cost = limit.cost.cost(request)
            except RequestError as exc:
                return Verdict(False, bad_request=f"cannot read the cost of rule {limit.rule!r}: {exc}")
            spec = limit.cost.spec
            if spec == 1 and cost == 1:
                unit = _ONE_REQUEST
            else:
                unit = QuotaUnit.of(cost, fixed=isinstance(spec, int), content_bytes=spec == "body")
            (shadows if limit.shadow else planned).append(_Planned(limit, subject, cost, unit))
        verdict = Verdict(True)
        if planned:
            shown = await self._enforce(_groups(planned) if len(planned) > 1 else [planned], verdict)
            if shown:
                verdict.decision = combine([r for r, _ in shown])
                verdict.units = tuple([u for _, u in shown])
        if shadows and verdict.allowed:
            verdict.shadow = await self._shadow(_groups(shadows), verdict, request)
        return verdict

    async def _enforce(self, groups: list[list[_Planned]], verdict: Verdict) -> list[tuple[RuleDecision, QuotaUnit]]:
        """Decide the enforced groups all-or-nothing; the results to show, with their units."""
        if not groups:
            return []
        groups, decided = await self._attempt(groups)
        return await self._settle(groups, decided, verdict)

    async def _settle(self, groups: list[list[_Planned]], decided: list[Decision | StorageError],
                      verdict: Verdict) -> list[tuple[RuleDecision, QuotaUnit]]:
        """Record the enforced groups' outcomes (each group that failed for a configuration problem
        decided again limit by limit); the results to show, with their units."""
        if any(type(d) is not Decision for d in decided):
            split = _split_misconfigured(groups, decided)
            if split is not None:  # a rule the decider cannot decide must not take its group-mates with it
                groups, decided = await self._attempt(split)
        return self._record(groups, decided, verdict)

    async def _attempt(self, groups: list[list[_Planned]]) -> tuple[list[list[_Planned]], list[Decision | StorageError]]:
        """Hit every group if all allow: one call for one group, else peeks first (the groups decided)."""
        if len(groups) == 1:
            return groups, [await self._one(groups[0], self.decider.hit)]
        peek = getattr(self.decider, "peek", None)
        if peek is not None:
            peeked = await self._decide(groups, peek)
            if any(isinstance(d, Decision) and not d.allowed for d in peeked) or any(
                    isinstance(d, StorageError) and p.limit.on_error == "deny"
                    for group, d in zip(groups, peeked, strict=True) for p in group):
                return groups, peeked
            return groups, await self._decide(groups, self.decider.hit)
        decided: list[Decision | StorageError] = []
        for group in groups:  # no peek: stop at the first denial
            decided += await self._decide([group], self.decider.hit)
            if isinstance(decided[-1], Decision) and not decided[-1].allowed:
                break
        return groups[: len(decided)], decided

    @staticmethod
    async def _one(group: list[_Planned], call: _Call) -> Decision | StorageError:
        first = group[0]
        try:
            return await call(first.limit.rule if len(group) == 1 else [p.limit.rule for p in group],
                              first.subject, first.cost)
        except StorageError as exc:
            return exc

    async def _decide(self, groups: list[list[_Planned]], call: _Call) -> list[Decision | StorageError]:
        if len(groups) == 1:
            return [await self._one(groups[0], call)]
        return list(await asyncio.gather(*(self._one(g, call) for g in groups)))

    def _record(self, groups: list[list[_Planned]], decided: list[Decision | StorageError],
                verdict: Verdict) -> list[tuple[RuleDecision, QuotaUnit]]:
        shown: list[tuple[RuleDecision, QuotaUnit]] = []
        allowing: list[str] = []
        for group, outcome in zip(groups, decided, strict=True):
            per = None if isinstance(outcome, StorageError) else self._per_limit(group, outcome)
            if per is None:
                self._failed(group, outcome, verdict, enforced=True)
                continue
            for p, results in zip(group, per, strict=True):
                shown += [(result, p.unit) for result in results]
                if all(r.allowed for r in results):
                    allowing.append(p.limit.rule)
                else:
                    verdict.allowed = False
                    verdict.denied_by.append(p.limit.rule)
                    self._count(p.limit.rule, "denied")
        if verdict.allowed:  # all-or-nothing: a refused request was admitted by none of its limits
            for rule in allowing:
                self._count(rule, "allowed")
        return shown

    def _failed(self, group: Sequence[_Planned], outcome: Decision | StorageError, verdict: Verdict,
                enforced: bool) -> None:
        """The limits of a group that could not be decided: each by its on_error (shadow limits never deny)."""
        failure = outcome if isinstance(outcome, StorageError) else StorageError("results that cannot be told apart")
        for p in group:
            self._storage_failed(p.limit, failure)
            verdict.failed.append(p.limit.rule)
            self._count(p.limit.rule, f"error_{p.limit.on_error}")
            if enforced and p.limit.on_error == "deny":
                verdict.allowed = False
                verdict.denied_by.append(p.limit.rule)

    def _per_limit(self, group: Sequence[_Planned], decision: Decision) -> list[tuple[RuleDecision, ...]] | None:
        """Each limit's results; None (logged) when the decider's results cannot be told apart."""
        per = _attribute(group, decision.results)
        if per is None:
            self.attribution_lines.warn(
                "attribution", f"rule(s) {', '.join(p.limit.rule for p in group)} were decided as "
                f"{', '.join(r.rule for r in decision.results)}", "cannot tell whose result is whose; they fail by "
                "their on_error", "request(s) failed so")
        return per

    async def _shadow(self, groups: list[list[_Planned]], verdict: Verdict, request: RequestInfo) -> Decision | None:
        """Count an admitted request against the shadow limits; they never deny."""
        results: list[RuleDecision] = []
        for group, outcome in zip(groups, await self._decide(groups, self.decider.hit), strict=True):
            per = None if isinstance(outcome, StorageError) else self._per_limit(group, outcome)
            if per is None:
                self._failed(group, outcome, verdict, enforced=False)
                continue
            for p, mine in zip(group, per, strict=True):
                results += mine
                if all(r.allowed for r in mine):
                    self._count(p.limit.rule, "allowed")
                else:
                    verdict.shadow_denied.append(p.limit.rule)
                    self._count(p.limit.rule, "shadow_denied")
                    log.info("shadow limit %s would deny %s %s for %s", p.limit.rule, request.method,
                             request.path, p.subject)
        return combine(results) if results else None

    def _storage_failed(self, limit: LimitSpec, exc: StorageError) -> None:
        verdict = "open" if limit.on_error == "allow" else "closed"
        self.storage_lines.warn("storage", f"rate limit storage unavailable; rule {limit.rule} fails {verdict}",
                                str(exc), "request(s) failed so")

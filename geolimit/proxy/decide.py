"""The rate-limit step of a proxied request, shared by both request paths (no I/O of its own).

:func:`decide` matches the route, refuses over-long bodies and unreadable costs,
asks the guard, counts the outcome per limit and says either "forward, with these
informational headers" or "answer this locally" (a :class:`Local` answer: 400,
413, 429 or 503 as problem+json). The aiohttp handler (geolimit/proxy/handler.py)
and the fast path (geolimit/proxy/fast_server.py) both call it, so a request gets
the same answer whichever path serves it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from geolimit.errors import RequestError
from geolimit.http.guard import RoutePolicy, Verdict
from geolimit.http.headers import PROBLEM_TYPE, problem_body, problem_document, rate_limit_headers
from geolimit.http.keys import RequestInfo
from geolimit.proxy.metrics import ProxyMetrics
from geolimit.proxy.state import State

__all__ = ["Local", "decide", "local_problem"]

log = logging.getLogger("geolimit.proxy")


@dataclass(frozen=True, slots=True)
class Local:
    """A response the proxy makes itself (never forwarded)."""

    status: int
    headers: list[tuple[str, str]]  # besides Content-Type
    body: bytes
    content_type: str = PROBLEM_TYPE


def local_problem(status: int, title: str, detail: str, instance: str,
                  headers: Iterable[tuple[str, str]] = ()) -> Local:
    """An RFC 9457 answer; ``instance`` is the request path (percent-encoded here)."""
    return Local(status, list(dict(headers).items()), problem_document(status, title, detail, instance))


async def decide(state: State, metrics: ProxyMetrics,
                 info: RequestInfo) -> tuple[str, Local | None, list[tuple[str, str]]]:
    """``(route template, local answer or None, headers to add to the forwarded response)``."""
    config = state.config
    route = ""
    guard = state.guard
    found = guard.match(info)
    if found is not None:
        route = found[0].route.template
    if config.max_body is not None and (info.content_length or 0) > config.max_body:
        return route, local_problem(413, "Content Too Large", f"the body exceeds {config.max_body} bytes",
                                    info.path), []
    if found is None or not found[0].limits:
        return route, None, []
    policy = found[0]
    one = guard.one_call(policy)
    if one is not None:  # one hit decides the route (no cost to read from the request)
        try:
            outcome = await guard.check_one(one, info, found[1])
        except RequestError as exc:
            return route, local_problem(400, "Bad Request", f"cannot rate-limit this request: {exc}", info.path), []
        if isinstance(outcome, Verdict):
            return _verdict(route, policy, outcome, metrics, info, config.legacy_headers)
        for name in one.names:  # every limit allowed it
            metrics.decision(route, name, "allowed")
        return route, None, rate_limit_headers(outcome, legacy=config.legacy_headers, units=one.units)
    if id(policy) in state.checked_costs:
        for limit in policy.limits:
            try:
                limit.cost.cost(info)
            except RequestError as exc:
                return route, local_problem(400, "Bad Request", f"cannot read the cost of rule {limit.rule!r}: {exc}",
                                            info.path), []
    try:
        verdict = await guard.check(info)
    except RequestError as exc:
        return route, local_problem(400, "Bad Request", f"cannot rate-limit this request: {exc}", info.path), []
    return _verdict(route, policy, verdict, metrics, info, config.legacy_headers)


def _verdict(route: str, policy: RoutePolicy, verdict: Verdict, metrics: ProxyMetrics, info: RequestInfo,
             legacy: bool) -> tuple[str, Local | None, list[tuple[str, str]]]:
    _count(metrics, route, policy, verdict)
    if not verdict.allowed:
        return route, _refusal(info, verdict, legacy), []
    # informational; a shadow limit's wait is no reason to come back later
    return route, None, [h for h in verdict.headers(legacy) if h[0] != "Retry-After"]


def _count(metrics: ProxyMetrics, route: str, policy: RoutePolicy, verdict: Verdict) -> None:
    failed, shadow, denied = list(verdict.failed), list(verdict.shadow_denied), list(verdict.denied_by)
    for limit in policy.limits:
        rule = limit.rule
        if limit.shadow and not verdict.allowed:
            continue  # shadow limits count only the requests the enforced ones admit
        if rule in failed:
            failed.remove(rule)
            if rule in denied and limit.on_error == "deny" and not limit.shadow:
                denied.remove(rule)
            result = f"error_{limit.on_error}"
        elif rule in shadow:
            shadow.remove(rule)
            result = "shadow_denied"
        elif rule in denied:
            denied.remove(rule)
            result = "denied"
        elif not verdict.allowed:
            continue  # all-or-nothing: another limit refused the request, this one admitted nothing
        else:
            result = "allowed"
        metrics.decision(route, rule, result)


def _refusal(info: RequestInfo, verdict: Verdict, legacy: bool) -> Local:
    headers = verdict.headers(legacy)
    decision = verdict.decision
    if verdict.bad_request is not None:
        return local_problem(400, "Bad Request", verdict.bad_request, info.path)
    if decision is not None and not decision.allowed:
        log.debug("denied %s %s by %s", info.method, info.path, ", ".join(verdict.denied_by))
        return Local(429, headers, problem_body(decision, info.path))
    names = ", ".join(verdict.denied_by)
    return local_problem(503, "Service Unavailable",
                         f"the rate limit storage is unavailable and rule(s) {names} fail closed",
                         info.path, [*headers, ("Retry-After", "1")])

"""What the ASGI and aiohttp middlewares share: request building, policies and replies.

Both middlewares decide a request with a :class:`~geolimit.http.guard.Guard`
(subjects over 4096 bytes, such as a huge API key header, are hashed to
``sha256:<hex>`` as the proxy does) and turn its
:class:`~geolimit.http.guard.Verdict` into one of:

* **allowed**: the app runs; its response gets ``RateLimit-Policy`` and
  ``RateLimit`` (and ``X-RateLimit-*`` with ``legacy_headers``) unless it set
  them itself;
* **429 Too Many Requests**: an enforced limit denied; ``Retry-After``, the rate
  limit headers and an ``application/problem+json`` body (RFC 9457);
* **400 Bad Request**: the cost could not be read from the request (a garbage
  or huge cost header, a byte-quota route without ``Content-Length``);
* **503 Service Unavailable** with ``Retry-After: 1``: Redis (or the agent) is
  unreachable and a limit is configured to fail closed (``on_error="deny"``).
  Not a 429, so clients and dashboards can tell an outage from a real limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from geolimit.core.decision import Decision
from geolimit.core.rule import Rule
from geolimit.errors import ConfigError, RequestError
from geolimit.http.guard import Decider, Guard, LimitSpec, RoutePolicy, Verdict
from geolimit.http.guarded_decider import GuardedDecider
from geolimit.http.headers import PROBLEM_TYPE, problem_body, problem_document
from geolimit.http.keys import CostSpec, KeySpec, RequestInfo, Route, bounded_subject
from geolimit.limiter import Limiter

__all__ = [
    "BoundedDecider",
    "Reply",
    "ThreadedDecider",
    "as_decider",
    "bounded_subject",
    "decide",
    "missing",
    "policy",
    "request_info",
]

log = logging.getLogger("geolimit.middleware")


class BoundedDecider(GuardedDecider):
    """Passes decisions on, hashing subjects over 4096 bytes (:func:`bounded_subject`).

    A decision that fails for a configuration problem (a rule the agent does not know,
    one removed from the limiter since, a window that disagrees with Redis) becomes a
    :class:`~geolimit.errors.StorageError`, logged at ERROR at most every 10 s, so
    the limit fails by its ``on_error`` instead of answering 500, as in the proxy
    (:class:`~geolimit.http.guarded_decider.GuardedDecider`).
    """

    def __init__(self, inner: Decider) -> None:
        super().__init__(inner, log, prefix="middleware: ")


class ThreadedDecider:
    """Adapts a synchronous :class:`~geolimit.Limiter` to the async ``Decider`` protocol.

    Each decision runs in the event loop's default thread pool, so the loop never
    blocks on Redis. An :class:`~geolimit.AsyncLimiter` is faster (it pipelines
    concurrent decisions); use this only when the app already has a sync limiter.
    """

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    async def hit(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        return await asyncio.to_thread(self.limiter.hit, rules, subject, cost)

    async def peek(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        return await asyncio.to_thread(self.limiter.peek, rules, subject, cost)


def as_decider(limiter: Decider | Limiter) -> Decider:
    """An async decider from an AsyncLimiter, an AgentClient or a sync Limiter."""
    return BoundedDecider(ThreadedDecider(limiter) if isinstance(limiter, Limiter) else limiter)


def policy(
    path: str,
    rule: str | Rule | Sequence[str | Rule],
    *,
    key: str = "ip",
    cost: int | str = 1,
    methods: Iterable[str] | None = None,
    shadow: bool = False,
    on_error: Literal["allow", "deny"] = "allow",
) -> RoutePolicy:
    """A :class:`RoutePolicy`: ``policy("/api/*", "api", key="header:X-API-Key")``.

    ``rule`` is a rule name, or several (names or :class:`~geolimit.Rule`
    objects, such as ``Rule.parse_many("api", "10/hour;5/minute")``), decided
    all-or-nothing with the same key and cost. ``path`` is a route template
    (``/users/{id}``, ``/static/*``); ``key`` and ``cost`` are :class:`KeySpec`
    and :class:`CostSpec` texts. For limits with different keys or costs build
    ``RoutePolicy(Route(...), (LimitSpec(...), ...))`` directly.
    """
    allowed = None if methods is None else frozenset(m.upper() for m in methods)
    items: Sequence[str | Rule] = [rule] if isinstance(rule, (str, Rule)) else rule
    names = [item.name if isinstance(item, Rule) else item for item in items]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"policy {path!r}: rule must be a rule name or a non-empty list of names, got {rule!r}")
    limits = tuple(LimitSpec(name, KeySpec(key), CostSpec(cost), shadow=shadow, on_error=on_error) for name in names)
    return RoutePolicy(Route(path, allowed), limits)


def request_info(
    method: str, path: str, headers: Iterable[tuple[str, str]], peer: str | None
) -> RequestInfo:
    """A :class:`RequestInfo` from raw header pairs.

    Names are lower-cased; repeated fields are joined with ``", "`` (RFC 9110
    §5.3), so several ``X-Forwarded-For`` lines read as one list. A missing or
    malformed ``Content-Length`` gives ``content_length=None``.
    """
    merged: dict[str, str] = {}
    for name, value in headers:
        name = name.lower()
        merged[name] = f"{merged[name]}, {value}" if name in merged else value
    raw_length = merged.get("content-length", "").strip()
    length = int(raw_length) if raw_length.isascii() and raw_length.isdigit() else None
    return RequestInfo(method.upper(), path, merged, peer, length)


@dataclass(frozen=True)
class Reply:
    """A response the middleware sends itself instead of running the app."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def _reply(status: int, headers: list[tuple[str, str]], body: bytes) -> Reply:
    return Reply(status, [*headers, ("Content-Type", PROBLEM_TYPE), ("Content-Length", str(len(body)))], body)


async def decide(guard: Guard, request: RequestInfo, legacy: bool) -> tuple[Verdict, Reply | None]:
    """The guard's verdict and, unless the app should run, the reply to send instead."""
    try:
        verdict = await guard.check(request)
    except RequestError as exc:  # e.g. a cost header of 2**60
        verdict = Verdict(False, bad_request=f"cannot rate limit this request: {exc}")
    if verdict.allowed:
        return verdict, None
    if verdict.bad_request is not None:
        return verdict, _reply(400, [], problem_document(400, "Bad Request", verdict.bad_request, request.path))
    decision = verdict.decision
    if decision is not None and not decision.allowed:
        return verdict, _reply(429, verdict.headers(legacy), problem_body(decision, request.path))
    # Only limits that fail closed denied: the limiter itself is unavailable.
    headers = [(n, v) for n, v in verdict.headers(legacy) if n != "Retry-After"] + [("Retry-After", "1")]
    rules = ", ".join(map(repr, verdict.denied_by))
    detail = f"rate limiting is unavailable and {rules} {'fail' if len(verdict.denied_by) > 1 else 'fails'} closed"
    return verdict, _reply(503, headers, problem_document(503, "Service Unavailable", detail, request.path))


def missing(headers: Sequence[tuple[str, str]], present: Iterable[str]) -> list[tuple[str, str]]:
    """``headers`` minus the names (case-insensitive) already in ``present``."""
    have = {name.lower() for name in present}
    return [(name, value) for name, value in headers if name.lower() not in have]

"""Rate-limit response headers and problem documents (no I/O).

* ``RateLimit-Policy`` and ``RateLimit``: draft-ietf-httpapi-ratelimit-headers-11,
  as Structured Field Lists::

      RateLimit-Policy: "api";q=100;w=60, "upload";q=1048576;qu="content-bytes";w=3600
      RateLimit: "api";r=42;t=5, "upload";r=524288;t=0

  ``q`` is the quota and ``w`` the window in seconds (left out when the window
  is not a whole number of seconds). ``r`` is the available quota: a request
  costing at most ``r`` is admitted now. ``t`` is the effective window: the
  number of seconds within which the client can use no more than ``r`` (it is
  rounded down, and never later than ``Retry-After``). A route whose requests
  each cost ``k`` counts requests: ``q = limit // k``, ``r = remaining // k``.
  A byte quota (cost ``body``) sends ``qu="content-bytes"``. Other costs (a
  ``header:NAME`` cost) count the rule's own units.
* ``Retry-After`` (delay-seconds, rounded up) on denials: the end of every
  effective window it comes with. A request that can never be admitted (its
  cost is above a rule's limit) gets none: waiting would not help, and the
  problem document says so (``retry_after`` is ``null``).
* Optionally the de-facto ``X-RateLimit-Limit``, ``-Remaining`` (``q`` and ``r``
  of the binding rule) and ``-Reset`` (seconds until its window is empty).
* Problem documents (RFC 9457): a denial is the draft's ``quota-exceeded``
  problem type with ``violated-policies``; ``instance`` is the request path as a
  percent-encoded URI reference.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

from geolimit.core.decision import Decision, RuleDecision
from geolimit.errors import RequestError

__all__ = [
    "PROBLEM_TYPE", "QUOTA_EXCEEDED", "QuotaUnit", "problem_body", "problem_document", "problem_instance",
    "rate_limit_headers", "sf_string",
]

PROBLEM_TYPE = "application/problem+json"
#: The draft's problem type for a request over one or more quota policies.
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
_QUOTA_EXCEEDED_TITLE = "Request cannot be satisfied as assigned quota has been exceeded"
#: Characters a URI path keeps as they are (RFC 3986 pchar and "/").
_PATH_SAFE = "/:@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class QuotaUnit:
    """How one rule's quota is shown for one request.

    ``per_request``: the units every request of the route costs (an integer
    cost); ``q`` and ``r`` then count requests. ``cost``: this request's cost.
    ``content_bytes``: the quota counts body bytes (``qu="content-bytes"``).
    """

    per_request: int = 1
    cost: int = 1
    content_bytes: bool = False

    @classmethod
    def of(cls, cost: int, *, fixed: bool, content_bytes: bool = False) -> QuotaUnit:
        """The unit of a limit whose request cost ``cost`` (``fixed``: every request costs that)."""
        return cls(cost if fixed and cost > 1 else 1, cost, content_bytes)


_REQUEST = QuotaUnit()


def sf_string(value: str) -> str:
    """A Structured Field String (RFC 9651 §3.3.3): printable ASCII, quoted."""
    out = ['"']
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append("?")  # not representable in an sf-string
    out.append('"')
    return "".join(out)


def _ceil(value: float) -> int:
    if not math.isfinite(value):
        return 0
    return max(0, math.ceil(value - 1e-9))


def _floor(value: float) -> int:
    if not math.isfinite(value):
        return 0
    return max(0, math.floor(value + 1e-9))


class _Shown:
    """One rule as the headers show it."""

    __slots__ = ("available", "quota", "result", "unit", "window")

    def __init__(self, result: RuleDecision, unit: QuotaUnit, retry_after: int | None) -> None:
        k = unit.per_request
        if not result.allowed and unit.cost == k and math.isfinite(result.retry_after):
            # Not one more request of this cost fits until it is admitted.
            effective = _floor(result.retry_after)
        else:
            effective = _floor(result.stable_for)
        if retry_after is not None and effective > retry_after:
            effective = retry_after
        self.result = result
        self.unit = unit
        self.quota = result.limit // k
        self.available = result.remaining // k
        self.window = effective  # the effective window, t

    def policy(self) -> str:
        return _policy(self.result.rule, self.quota, self.unit.content_bytes, self.result.window)

    def current(self) -> str:
        return f"{_name(self.result.rule)};r={self.available};t={self.window}"


@functools.lru_cache(maxsize=1024)
def _name(rule: str) -> str:
    return sf_string(rule)


@functools.lru_cache(maxsize=1024)
def _policy(rule: str, quota: int, content_bytes: bool, window: float) -> str:
    """One item of RateLimit-Policy."""
    item = f"{_name(rule)};q={quota}"
    if content_bytes:
        item += ';qu="content-bytes"'
    if window >= 1 and float(window).is_integer():
        item += f";w={int(window)}"
    return item


def _retry_after(decision: Decision) -> int | None:
    """Retry-After of a denial; None when no wait helps (a cost above a rule's limit never fits)."""
    retry = decision.retry_after
    if math.isfinite(retry):
        return max(1, _ceil(retry))
    return None


def rate_limit_headers(
    decision: Decision, *, legacy: bool = False, units: Sequence[QuotaUnit] | None = None
) -> list[tuple[str, str]]:
    """The headers for a response decided by ``decision`` (allowed or denied).

    ``units`` (one per ``decision.results`` item; default: each request costs
    one unit) say how each quota is counted.
    """
    results = decision.results or ()
    if units is not None and len(units) != len(results):
        raise RequestError(f"{len(units)} quota units for {len(results)} rule results")
    if len(results) == 1 and decision.allowed and results[0].allowed and not legacy:  # the common case
        result = results[0]
        unit = units[0] if units is not None else _REQUEST
        k = unit.per_request
        return [("RateLimit-Policy", _policy(result.rule, result.limit // k, unit.content_bytes, result.window)),
                ("RateLimit", f"{_name(result.rule)};r={result.remaining // k};t={_floor(result.stable_for)}")]
    retry = None if decision.allowed else _retry_after(decision)  # None too when the request can never pass
    shown = [_Shown(r, units[i] if units is not None else _REQUEST, retry) for i, r in enumerate(results)]
    headers = [
        ("RateLimit-Policy", ", ".join([s.policy() for s in shown])),
        ("RateLimit", ", ".join([s.current() for s in shown])),
    ]
    if retry is not None:
        headers.append(("Retry-After", str(retry)))
    if legacy and shown:
        binding = _binding(shown, decision.allowed)
        headers += [
            ("X-RateLimit-Limit", str(binding.quota)),
            ("X-RateLimit-Remaining", str(binding.available)),
            ("X-RateLimit-Reset", str(_ceil(binding.result.reset_after))),
        ]
    return [(name, value) for name, value in headers if value]


def _binding(shown: Sequence[_Shown], allowed: bool) -> _Shown:
    """The rule that decided: the denial with the longest wait, else the least available."""
    if not allowed:
        denying = [s for s in shown if not s.result.allowed]
        if denying:
            return max(denying, key=lambda s: s.result.retry_after)
    return min(shown, key=lambda s: (s.available, -s.result.reset_after))


def problem_instance(path: str) -> str:
    """``path`` as a URI reference: percent-encoded UTF-8, never mistaken for ``//authority``."""
    encoded = quote(path or "/", safe=_PATH_SAFE)
    if not encoded.startswith("/"):
        encoded = "/" + encoded
    if encoded.startswith("//"):
        encoded = "/%2F" + encoded[2:]
    return encoded


def problem_document(status: int, title: str, detail: str, instance: str | None = None,
                     problem_type: str = "about:blank", **members: object) -> bytes:
    """An RFC 9457 document; ``instance`` is a request path (encoded here)."""
    doc: dict[str, object] = {"type": problem_type, "title": title, "status": status, "detail": detail}
    if instance is not None:
        doc["instance"] = problem_instance(instance)
    doc.update(members)
    return json.dumps(doc).encode()


def problem_body(decision: Decision, instance: str | None = None) -> bytes:
    """The problem document of a denial: ``quota-exceeded`` with ``violated-policies``.

    ``instance`` is the request path. The extension members ``rule``, ``limit``,
    ``remaining`` and ``retry_after`` (seconds; ``null`` when the cost can never
    fit, and the response then has no ``Retry-After``) describe the binding rule.
    """
    retry = decision.retry_after
    # The binding rule's window (a multi-rate route said "5 per 3600 s" for its 5/minute).
    binding = [r.window for r in decision.results if r.rule == decision.rule]
    window = _ceil(binding[0] if binding else max((r.window for r in decision.results), default=0))
    detail = (
        f"rate limit {decision.rule!r} exceeded: {decision.limit} per {window} s" if math.isfinite(retry)
        else f"the request costs more than rule {decision.rule!r} allows in a whole window: it can never be "
             f"admitted, and retrying will not help"
    )
    violated = [r.rule for r in decision.results if not r.allowed] or [decision.rule]
    return problem_document(
        429, _QUOTA_EXCEEDED_TITLE, detail, instance, QUOTA_EXCEEDED,
        **{
            "violated-policies": violated,
            "rule": decision.rule,
            "limit": decision.limit,
            "remaining": decision.remaining,
            "retry_after": retry if math.isfinite(retry) else None,
        },
    )

"""Rate-limit response headers and the 429 body (no I/O).

* ``RateLimit-Policy`` and ``RateLimit``: the IETF httpapi ratelimit-headers draft
  (draft-ietf-httpapi-ratelimit-headers-08 and later), as Structured Field Lists::

      RateLimit-Policy: "api";q=100;w=60, "burst";q=10;w=1
      RateLimit: "api";r=42;t=17, "burst";r=0;t=1

  ``q`` is the quota (the rule's limit), ``w`` its window in seconds, ``r`` the
  remaining quota and ``t`` the seconds until it is fully available again.
* ``Retry-After`` (delay-seconds, rounded up) on denials.
* Optionally the de-facto ``X-RateLimit-Limit``, ``-Remaining`` and ``-Reset``
  of the binding rule.
* A denial's body is ``application/problem+json`` (RFC 9457).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from geolimit.core.decision import Decision, RuleDecision

__all__ = ["PROBLEM_TYPE", "problem_body", "rate_limit_headers", "sf_string"]

PROBLEM_TYPE = "application/problem+json"


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


def _seconds(value: float) -> int:
    if not math.isfinite(value):
        return 0
    return max(0, math.ceil(value - 1e-9))


def _policy(result: RuleDecision) -> str:
    return f"{sf_string(result.rule)};q={result.limit};w={_seconds(result.window)}"


def _current(result: RuleDecision) -> str:
    return f"{sf_string(result.rule)};r={result.remaining};t={_seconds(result.reset_after)}"


def rate_limit_headers(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    """The headers for a response decided by ``decision`` (allowed or denied)."""
    results: Iterable[RuleDecision] = decision.results or ()
    headers = [
        ("RateLimit-Policy", ", ".join(_policy(r) for r in results)),
        ("RateLimit", ", ".join(_current(r) for r in results)),
    ]
    if not decision.allowed:
        retry = decision.retry_after
        # A cost above the limit never fits: no useful Retry-After; advertise the window.
        wait = _seconds(retry) if math.isfinite(retry) else _seconds(max((r.window for r in results), default=1))
        headers.append(("Retry-After", str(max(1, wait))))
    if legacy:
        headers += [
            ("X-RateLimit-Limit", str(decision.limit)),
            ("X-RateLimit-Remaining", str(decision.remaining)),
            ("X-RateLimit-Reset", str(_seconds(decision.reset_after))),
        ]
    return [(name, value) for name, value in headers if value]


def problem_body(decision: Decision, instance: str | None = None) -> bytes:
    """The RFC 9457 problem document of a denial."""
    retry = decision.retry_after
    doc: dict[str, object] = {
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": (
            f"rate limit {decision.rule!r} exceeded: {decision.limit} per "
            f"{_seconds(max((r.window for r in decision.results), default=0))} s"
            if math.isfinite(retry) else
            f"the request costs more than rule {decision.rule!r} allows in a whole window"
        ),
        "rule": decision.rule,
        "limit": decision.limit,
        "remaining": decision.remaining,
        "retry_after": retry if math.isfinite(retry) else None,
    }
    if instance:
        doc["instance"] = instance
    return json.dumps(doc).encode()

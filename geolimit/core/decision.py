"""Decisions: what a hit, peek or check returns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from geolimit.core.rule import Rule
from geolimit.core.window import Evaluation

__all__ = ["Decision", "RuleDecision", "combine", "degraded_decision", "rule_decision", "to_rule_decision"]


@dataclass(slots=True)
class RuleDecision:
    """The outcome for one rule of a request.

    Times are seconds. ``retry_after`` is 0 when allowed and ``math.inf`` when the
    cost is larger than the limit (the request can never be allowed).
    ``reset_after`` is the time until the window holds nothing. ``stable_for`` is
    a time during which ``remaining`` cannot grow with no new traffic and no news
    from peers (the headers' ``t``). In strict mode it is exact: until the oldest
    bucket holding a count leaves the window (the whole window when none does),
    cut to when a reserve predicted for peers may shrink (the first end of a
    peer's prediction, :attr:`geolimit.core.policy.Reservation.falls_at_us`); a denied rule counting more
    than its limit keeps ``remaining`` at 0 longer. In approximate mode it is 0
    (the oldest bucket's weight shrinks continuously) unless nothing (the whole
    window) or one unit (until its bucket leaves) is counted. Escrow rules: until
    the oldest own step that counts stops counting (rights moved by the agent
    are news). A plain record (not frozen: building frozen dataclasses costs a
    microsecond each on the decision path).
    """

    rule: str
    allowed: bool
    limit: int
    remaining: int
    retry_after: float
    reset_after: float
    window: float
    stable_for: float = 0.0


@dataclass(slots=True)
class Decision:
    """The outcome of a request over one or more rules (all-or-nothing).

    ``limit``, ``remaining`` and ``reset_after`` are those of the *binding* rule:
    the denying rule with the longest wait, or, when allowed, the rule with the
    least remaining. ``retry_after`` is how long to wait before the same request
    can succeed (the longest wait over all denying rules). ``degraded`` is True
    when Redis could not be reached and the limiter's ``on_error`` policy decided.
    """

    allowed: bool
    limit: int
    remaining: int
    retry_after: float
    reset_after: float
    rule: str
    results: tuple[RuleDecision, ...] = ()
    degraded: bool = False
    error: str | None = None

    def __bool__(self) -> bool:
        return self.allowed

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``retry_after`` is ``None`` when it is infinite)."""
        return {
            "allowed": self.allowed,
            "limit": self.limit,
            "remaining": self.remaining,
            "retry_after": _finite(self.retry_after),
            "reset_after": self.reset_after,
            "rule": self.rule,
            "degraded": self.degraded,
            "rules": [
                {
                    "rule": r.rule,
                    "allowed": r.allowed,
                    "limit": r.limit,
                    "remaining": r.remaining,
                    "retry_after": _finite(r.retry_after),
                    "reset_after": r.reset_after,
                    "window": r.window,
                    "stable_for": r.stable_for,
                }
                for r in self.results
            ],
        }


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def rule_decision(rule: Rule, allowed: int, used: int, retry_us: int, reset_us: int, stable_us: int) -> RuleDecision:
    """A :class:`RuleDecision` from the script's integers (microseconds)."""
    remaining = rule.limit - used
    return RuleDecision(
        rule.name,
        allowed == 1,
        rule.limit,
        remaining if remaining > 0 else 0,
        math.inf if retry_us < 0 else retry_us / 1e6,
        reset_us / 1e6,
        rule.window_us / 1e6,
        stable_us / 1e6,
    )


def to_rule_decision(rule: Rule, evaluation: Evaluation) -> RuleDecision:
    """Convert an integer-microsecond :class:`Evaluation` for ``rule``."""
    return rule_decision(
        rule, int(evaluation.allowed), evaluation.used, evaluation.retry_after_us, evaluation.reset_after_us,
        evaluation.stable_us,
    )


def combine(results: Sequence[RuleDecision]) -> Decision:
    """All-or-nothing combination of per-rule results."""
    if len(results) == 1:
        r = results[0]
        return Decision(r.allowed, r.limit, r.remaining, r.retry_after, r.reset_after, r.rule, (r,))
    if not results:
        raise ValueError("a decision needs at least one rule result")
    allowed = all(r.allowed for r in results)
    if allowed:
        binding = min(results, key=lambda r: (r.remaining, -r.reset_after))
        retry = 0.0
    else:
        denying = [r for r in results if not r.allowed]
        binding = max(denying, key=lambda r: r.retry_after)
        retry = binding.retry_after
    return Decision(
        allowed=allowed,
        limit=binding.limit,
        remaining=binding.remaining,
        retry_after=retry,
        reset_after=binding.reset_after,
        rule=binding.rule,
        results=tuple(results),
    )


def degraded_decision(rules: Sequence[Rule], allowed: bool, error: str) -> Decision:
    """The decision used when Redis is unreachable and ``on_error`` is allow or deny."""
    results = tuple(
        RuleDecision(
            rule=r.name,
            allowed=allowed,
            limit=r.limit,
            remaining=r.limit if allowed else 0,
            retry_after=0.0 if allowed else r.resolution_us / 1e6,
            reset_after=0.0,
            window=r.window_us / 1e6,
        )
        for r in rules
    )
    decision = combine(results)
    return Decision(
        allowed=decision.allowed,
        limit=decision.limit,
        remaining=decision.remaining,
        retry_after=decision.retry_after,
        reset_after=decision.reset_after,
        rule=decision.rule,
        results=results,
        degraded=True,
        error=error,
    )

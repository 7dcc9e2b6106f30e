"""What a :class:`~geolimit.http.guard.Guard` decides with, and the pure planning of a request's limits.

The configuration types (:class:`LimitSpec`, :class:`RoutePolicy`), the :class:`Decider`
a guard asks, the :class:`Verdict` it returns, and the helpers that need no decider:
grouping a route's limits into atomic calls, the one-call plan of a route
(:class:`OneCall`), splitting misconfigured groups, and telling whose result is
whose. Everything here is importable from :mod:`geolimit.http.guard` as well.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.errors import GeolimitError, StorageError
from geolimit.http.headers import QuotaUnit, rate_limit_headers
from geolimit.http.keys import CostSpec, KeySpec, Route

__all__ = ["Decider", "LimitSpec", "OneCall", "RoutePolicy", "Verdict"]


class Decider(Protocol):
    """An :class:`~geolimit.AsyncLimiter`, or a client of the local agent.

    ``hit`` with several rule names decides them all-or-nothing. ``peek`` (which
    consumes nothing) is used for routes whose limits need several calls; a
    decider without it gets those decided one hit after the other.
    """

    async def hit(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision: ...

    async def peek(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision: ...


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
    """A request's outcome.

    ``decision`` combines the enforced limits' results (``None``: no route
    matched, the route has no enforced limit, or every one failed open);
    ``units`` says how each of its results is counted in the headers.
    ``shadow`` combines the shadow limits' results (never shown to clients).
    """

    allowed: bool
    decision: Decision | None = None
    denied_by: list[str] = field(default_factory=list)  # enforced rules that denied
    shadow_denied: list[str] = field(default_factory=list)  # shadow rules that would have denied
    failed: list[str] = field(default_factory=list)  # rules decided by on_error (storage down)
    bad_request: str | None = None  # the cost could not be read from the request
    units: tuple[QuotaUnit, ...] = ()
    shadow: Decision | None = None

    def headers(self, legacy: bool = False) -> list[tuple[str, str]]:
        if self.decision is None:
            return []
        units = self.units if len(self.units) == len(self.decision.results) else None
        return rate_limit_headers(self.decision, legacy=legacy, units=units)


@dataclass
class _Planned:
    """One limit of a matched route, ready to decide."""

    limit: LimitSpec
    subject: str
    cost: int
    unit: QuotaUnit


def _groups(planned: Sequence[_Planned]) -> list[list[_Planned]]:
    """Limits that can be decided in one atomic call: the same subject and cost, distinct rules."""
    groups: list[list[_Planned]] = []
    for item in planned:
        for group in groups:
            head = group[0]
            if (head.subject, head.cost) == (item.subject, item.cost) and all(
                    p.limit.rule != item.limit.rule for p in group):
                group.append(item)
                break
        else:
            groups.append([item])
    return groups


@dataclass(frozen=True, slots=True)
class OneCall:
    """A route whose limits one ``hit`` decides: all enforced, distinct rules, one key and one fixed cost.

    :meth:`Guard.check_one` decides its requests with less work than the general
    path of :meth:`Guard.check`, to the same verdicts.
    """

    policy: RoutePolicy
    rules: str | tuple[str, ...]  # what ``hit`` is given: a name, or the names in order
    names: tuple[str, ...]
    key: KeySpec
    cost: int
    units: tuple[QuotaUnit, ...]
    counted: tuple[tuple[str, str], ...]  # the counters of an allowed request

    @classmethod
    def of(cls, policy: RoutePolicy) -> OneCall | None:
        limits = policy.limits
        if not limits:
            return None
        first = limits[0]
        spec = first.cost.spec
        names = tuple(limit.rule for limit in limits)
        if (not isinstance(spec, int) or len(set(names)) != len(names)
                or any(limit.shadow or limit.key != first.key or limit.cost.spec != spec for limit in limits)):
            return None
        unit = _ONE_REQUEST if spec == 1 else QuotaUnit.of(spec, fixed=True)
        return cls(policy, names[0] if len(names) == 1 else names, names, first.key, spec,
                   (unit,) * len(names), tuple((name, "allowed") for name in names))


def _allowed(decision: Decision, one: OneCall) -> Verdict:
    """The verdict of a request that every limit of ``one`` allowed."""
    return Verdict(True, combine(decision.results), units=one.units)


_Call = Callable[[str | list[str], str, int], Awaitable[Decision]]
_ONE_REQUEST = QuotaUnit()


def _split_misconfigured(groups: list[list[_Planned]],
                         decided: Sequence[Decision | StorageError]) -> list[list[_Planned]] | None:
    """The groups again, with each group that failed for a configuration problem (a rule the agent
    does not know, a window that disagrees with Redis: a StorageError caused by another
    GeolimitError) split into single limits; None when there is none."""
    split: list[list[_Planned]] = []
    changed = False
    for group, outcome in zip(groups, decided, strict=False):
        cause = outcome.__cause__ if isinstance(outcome, StorageError) else None
        if len(group) > 1 and isinstance(cause, GeolimitError) and not isinstance(cause, StorageError):
            split += [[p] for p in group]
            changed = True
        else:
            split.append(group)
    return split if changed else None


def _attribute(group: Sequence[_Planned], results: Sequence[RuleDecision]) -> list[tuple[RuleDecision, ...]] | None:
    """Each limit's results: one each, in order; or, when the decider decided a name as several rules (an
    agent's multi-rate ``[[rule]]`` table ``api`` as ``api.1h`` and ``api.1m``), the results named after it
    (``api`` or ``api.<window>``); None when that does not account for every result exactly once."""
    if len(results) == len(group):
        return [(r,) for r in results]
    out: list[tuple[RuleDecision, ...]] = []
    for p in group:
        name = p.limit.rule
        mine = tuple(r for r in results if r.rule == name or r.rule.startswith(name + "."))
        if not mine:
            return None
        out.append(mine)
    return out if sum(len(m) for m in out) == len(results) else None

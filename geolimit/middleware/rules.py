"""The middlewares' routes checked against the limiter's rules when the middleware is set up.

With a :class:`~geolimit.Limiter` or an :class:`~geolimit.AsyncLimiter` the rules are
known, so, as the proxy refuses its ``proxy.toml``:

* a limit naming a rule the limiter does not know is a :class:`~geolimit.errors.ConfigError`
  naming the route and the rule and listing the known ones (not a 500 on every
  matching request);
* a limit naming a multi-rate group (``api`` for the rules ``api.10s`` and ``api.1h``
  of ``Rule.parse_many("api", "100/10s;1000/hour")``) becomes one limit per rule of
  the group, decided all-or-nothing, as the proxy and the agent's ``/v1/check`` expand
  a ``[[rule]]`` table's name. A limiter knows no groups, so a group is what
  ``parse_many`` makes: two or more rules named ``<name>.<window>``, each suffix the
  rule's own window (:func:`~geolimit.core.rule.window_label`). A rule of that very
  name wins over a group.

An agent-backed decider (:class:`~geolimit.http.agent_client.AgentClient`) is not checked
at setup: the middlewares are built synchronously, before the event loop serves, and
the agent may not be up yet (the proxy starts all the same when its agent cannot be
asked). The agent expands its tables' names itself; a rule it does not know fails by
the limit's ``on_error`` on every request, logged at ERROR at most every 10 s
(:class:`~geolimit.middleware.common.BoundedDecider`), never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.rule import Rule, window_label
from geolimit.errors import ConfigError
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.limiter import Limiter

__all__ = ["checked_routes", "rule_groups"]


def rule_groups(rules: Mapping[str, Rule]) -> dict[str, tuple[str, ...]]:
    """The multi-rate groups among ``rules``: ``{"api": ("api.10s", "api.1h")}`` (see the module docstring)."""
    members: dict[str, list[str]] = {}
    for name, rule in sorted(rules.items()):
        base, dot, label = name.rpartition(".")
        if dot and base and label == window_label(rule.window):
            members.setdefault(base, []).append(name)
    return {base: tuple(names) for base, names in members.items() if len(names) > 1 and base not in rules}


def _known(rules: Mapping[str, Rule], groups: Mapping[str, tuple[str, ...]]) -> str:
    names = ", ".join(sorted(rules)) or "none"
    tables = ", ".join(f"{g} ({' + '.join(m)})" for g, m in sorted(groups.items()))
    return f"known rules: {names}" + (f"; multi-rate groups: {tables}" if tables else "")


def _unknown(where: str, name: str, rules: Mapping[str, Rule], groups: Mapping[str, tuple[str, ...]]) -> str:
    message = f"{where}: unknown rule {name!r}; {_known(rules, groups)}"
    prefixed = sorted(r for r in rules if r.startswith(name + "."))
    if prefixed:  # parse_many's rules, but not a group (one of them, or other suffixes): name them
        message += (f". Rules made by Rule.parse_many({name!r}, ...) are named <name>.<window>: name them, "
                    f"as rule=[{', '.join(map(repr, prefixed))}] (decided all-or-nothing)")
    return message


def checked_routes(decider: object, routes: Sequence[RoutePolicy]) -> tuple[RoutePolicy, ...]:
    """``routes`` checked against the rules of ``decider`` when it is a Limiter or an AsyncLimiter (a
    :class:`ConfigError` for a name it does not know), with group names expanded; other deciders: unchanged."""
    if not isinstance(decider, (Limiter, AsyncLimiter)):
        return tuple(routes)
    rules = decider.rules
    groups = rule_groups(rules)
    out: list[RoutePolicy] = []
    for i, policy in enumerate(routes):
        where = f"route[{i}] (path {policy.route.template!r})"
        limits: list[LimitSpec] = []
        for limit in policy.limits:
            names = (limit.rule,) if limit.rule in rules else groups.get(limit.rule)
            if names is None:
                raise ConfigError(_unknown(where, limit.rule, rules, groups))
            for name in names:
                if any((o.rule, o.key, o.cost, o.shadow) == (name, limit.key, limit.cost, limit.shadow) for o in limits):
                    via = f" (directly and by its group {limit.rule!r})" if name != limit.rule else ""
                    raise ConfigError(f"{where}: rule {name!r} is named twice{via} with the same key and cost")
                limits.append(limit if name == limit.rule else replace(limit, rule=name))
        same = len(limits) == len(policy.limits)
        out.append(policy if same else RoutePolicy(policy.route, tuple(limits)))
    return tuple(out)

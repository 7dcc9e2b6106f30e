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

An agent-backed decider (:class:`~geolimit.http.agent_client.AgentClient`) cannot be
checked when the middleware is built: that is synchronous, before the event loop
serves, and the agent may not be up yet. So, as the proxy does in agent mode
(geolimit/proxy/agent_rules.py), :func:`check_agent_routes` asks the agent for its rules
and multi-rate tables at start: :func:`~geolimit.middleware.setup_geolimit` registers
it on the aiohttp app's ``on_startup`` (an unknown name fails the app's start with a
ConfigError naming the route and the rule); an ASGI app can await it in its lifespan
startup. An agent that cannot be asked then is logged and not waited for. The agent
expands its tables' names itself, and a rule it does not know fails by the limit's
``on_error`` on every request, logged at ERROR at most every 10 s
(:class:`~geolimit.middleware.common.BoundedDecider`), never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.rule import Rule, window_label
from geolimit.errors import ConfigError, StorageError
from geolimit.http.agent_client import AgentClient
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.limiter import Limiter

__all__ = ["check_agent_routes", "checked_routes", "rule_groups"]

log = logging.getLogger("geolimit.middleware")


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


async def check_agent_routes(agent: AgentClient, routes: Sequence[RoutePolicy]) -> bool:
    """Ask ``agent`` for its rules (``GET /v1/status``) and check that it decides every limit of ``routes``:
    a :class:`ConfigError` naming the first route and rule it does not know. False (logged as a warning)
    when the agent cannot be asked now; True when every name is known."""
    try:
        rules = await agent.rules()
    except StorageError as exc:
        log.warning("middleware: cannot ask the agent for its rules now (%s); a limit it cannot decide fails by "
                    "its on_error", exc)
        return False
    for i, policy in enumerate(routes):
        for limit in policy.limits:
            if rules.expand(limit.rule) is None:
                names = ", ".join(sorted(rules.names)) or "none"
                tables = ", ".join(f"{t} ({' + '.join(m)})" for t, m in sorted(rules.groups.items()))
                raise ConfigError(f"route[{i}] (path {policy.route.template!r}): rule {limit.rule!r} is not one of "
                                  f"the agent's rules (it has {names}"
                                  + (f"; multi-rate tables {tables})" if tables else ")"))
    return True

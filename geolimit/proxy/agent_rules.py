"""Agent mode: the routes' limits checked against the rules the agent decides.

In library mode a limit names a ``[[rule]]`` table of ``proxy.toml`` and the file
is refused when it names none. In agent mode the rules are the agent's, so the
proxy asks the agent (``GET /v1/status``: its rules and its multi-rate tables) at
start and on every reload, and then, as library mode does:

* a limit naming a rule the agent does not know is a :class:`ConfigError` naming
  the route and the rule (the proxy does not start; a reload is refused);
* a limit naming a multi-rate table (``api`` for ``"10/hour;5/minute"``) becomes
  one limit per rule of the table (``api.1h``, ``api.1m``), decided all-or-nothing.

When the agent cannot be asked at start, the proxy starts all the same and asks
again every :data:`RETRY_INTERVAL` seconds until it answers; a limit the agent
cannot decide is then logged as an error, and fails by its ``on_error`` on every
request (logged at most every 10 s, and counted in ``/metrics``), never silently.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from geolimit.errors import ConfigError
from geolimit.http.agent_client import AgentRules
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.proxy.config import ProxyConfig

__all__ = ["RETRY_INTERVAL", "resolve_routes"]

log = logging.getLogger("geolimit.proxy")

#: Seconds between two attempts to learn the rules of an agent that could not be asked at start.
RETRY_INTERVAL = 1.0


def _known(rules: AgentRules) -> str:
    names = ", ".join(sorted(rules.names)) or "none"
    tables = ", ".join(f"{t} ({' + '.join(m)})" for t, m in sorted(rules.groups.items()))
    return f"it has {names}" + (f"; multi-rate tables {tables}" if tables else "")


def resolve_routes(config: ProxyConfig, rules: AgentRules, *, strict: bool) -> ProxyConfig:
    """``config`` with its limits checked against the agent's ``rules`` and its tables' names expanded.

    ``strict``: a limit the agent cannot decide raises :class:`ConfigError` naming the route and the rule;
    otherwise it is logged as an error and kept (it fails by its ``on_error`` on every request).
    """
    src = str(config.path) if config.path else "<config>"
    routes: list[RoutePolicy] = []
    for i, policy in enumerate(config.routes):
        limits: list[LimitSpec] = []
        for limit in policy.limits:
            names = rules.expand(limit.rule)
            if names is None:
                message = (f"{src}: route[{i}] (path {policy.route.template!r}): rule {limit.rule!r} is not one of "
                           f"the agent's rules ({_known(rules)})")
                if strict:
                    raise ConfigError(message)
                log.error("proxy: %s; that limit fails %s (on_error = %r) on every request", message,
                          "open" if limit.on_error == "allow" else "closed", limit.on_error)
                names = (limit.rule,)
            limits += [limit if name == limit.rule else replace(limit, rule=name) for name in names]
        same = len(limits) == len(policy.limits) and all(a is b for a, b in zip(limits, policy.limits, strict=True))
        routes.append(policy if same else RoutePolicy(policy.route, tuple(limits)))
    return replace(config, routes=tuple(routes))

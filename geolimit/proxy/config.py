"""The proxy's TOML configuration, validated strictly (errors name the key and the file).

A complete file (every key; only ``[proxy] upstreams``, one of ``redis_url`` /
``agent_url``, and ``region`` with ``redis_url`` are required)::

    [proxy]
    listen = "127.0.0.1:8080"             # default; loopback unless told otherwise
    admin_listen = "127.0.0.1:8081"       # /metrics, /healthz, /readyz (default: none)
    upstreams = ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]   # round robin
    connect_timeout = "5s"                # connecting to an upstream (default 5 s)
    timeout = "30s"                       # upstream silence: until headers -> 504 (default 30 s)
    body_timeout = "30s"                  # waiting for a request body, + 1 s per KiB received -> 408
    retry_connect = true                  # next upstream on connect failure (bodiless idempotent requests)
    preserve_host = false                 # false: Host = the upstream's; true: the client's
    fast_path = true                      # serve common requests without aiohttp (http:// upstreams only)
    trusted_proxies = ["10.0.0.0/8"]      # honour Forwarded / X-Forwarded-* from these peers
    legacy_headers = false                # also X-RateLimit-Limit / -Remaining / -Reset
    max_body = 10485760                   # bytes; 413 above (default: unlimited)
    shutdown_timeout = "10s"              # SIGTERM: in-flight requests may finish for this long
    region = "us-east"                    # required with redis_url
    redis_url = "redis://127.0.0.1:6379/0"   # library mode: decide in this Redis, or
    # agent_url = "http://127.0.0.1:7400"    # agent mode: POST /v1/check to the local agent
    # agent_token_file = "api.token"         # the agent's region.api_token_file
    decision_timeout = "1s"               # Redis / agent call timeout (then on_error applies)
    key_prefix = "gl"                     # library mode: as the region's agent (default gl)
    shards = 64                           # library mode: as the region's agent (default 64)
    workers = 1                           # processes sharing the ports (SO_REUSEPORT); > 1 needs fixed
                                          # ports; --workers overrides it (default 1)

    [[rule]]                              # library mode only (agent mode: the agent's rules, which the
                                          # routes are checked against at start: geolimit/proxy/agent_rules.py)
    name = "api"
    limit = "5/10s"                       # several rates make several rules: "10/hour;5/minute" gives
                                          # api.1h and api.1m, and a limit naming "api" applies both

    [[route]]                             # first match wins; no match: forwarded unlimited
    path = "/api/{version}/*"
    methods = ["GET", "POST"]             # optional
    limits = [ { rule = "api", key = "ip+header:X-API-Key", cost = 1, shadow = false, on_error = "allow" } ]

    [log]
    format = "text"                       # or "json"
    level = "INFO"
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from geolimit.core.rule import Rule
from geolimit.errors import ConfigError
from geolimit.http.guard import LimitSpec, RoutePolicy
from geolimit.http.keys import CostSpec, KeySpec, Route, trusted_networks
from geolimit.toml_config import (
    MAX_WORKERS,
    check_keys,
    check_workers,
    get_table,
    http_url_parts,
    load_toml,
    parse_listen,
    parse_log,
    parse_positive_int,
    parse_redis_url,
    parse_region,
    parse_rule_groups,
    parse_seconds,
    parse_shards,
    read_token,
    require,
    resolve_path,
)

__all__ = ["MAX_WORKERS", "ProxyConfig", "load_proxy_config", "parse_proxy_config", "with_workers"]

_PROXY_KEYS = {
    "listen", "admin_listen", "upstreams", "connect_timeout", "timeout", "body_timeout", "retry_connect",
    "preserve_host", "fast_path", "trusted_proxies", "legacy_headers", "max_body", "shutdown_timeout", "region", "redis_url", "agent_url",
    "agent_token_file", "decision_timeout", "key_prefix", "shards", "workers",
}
_ROUTE_KEYS = {"path", "methods", "limits"}
_LIMIT_KEYS = {"rule", "key", "cost", "shadow", "on_error"}
_METHOD_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass(frozen=True)
class ProxyConfig:
    upstreams: tuple[str, ...]
    routes: tuple[RoutePolicy, ...] = ()
    rules: tuple[Rule, ...] = ()
    redis_url: str | None = None
    agent_url: str | None = None
    agent_token: str | None = field(default=None, repr=False)
    region: str | None = None
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    admin_listen: tuple[str, int] | None = None
    connect_timeout: float = 5.0
    timeout: float = 30.0
    body_timeout: float = 30.0  # seconds waiting for a request body (+1 s per BODY_RATE bytes received)
    retry_connect: bool = True
    preserve_host: bool = False
    fast_path: bool = True  # geolimit/proxy/fast_server.py (off for https upstreams)
    trusted_proxies: tuple[str, ...] = ()
    legacy_headers: bool = False
    max_body: int | None = None
    shutdown_timeout: float = 10.0
    decision_timeout: float = 1.0
    key_prefix: str = "gl"
    shards: int = 64
    workers: int = 1  # proxy processes sharing the listeners (geolimit/supervisor.py)
    log_format: str = "text"
    log_level: str = "INFO"
    path: Path | None = None

    def __post_init__(self) -> None:
        if (self.redis_url is None) == (self.agent_url is None):
            raise ConfigError("give exactly one of redis_url (library mode) and agent_url (agent mode)")
        if self.redis_url is not None and self.region is None:
            raise ConfigError("library mode (redis_url) needs the region's name")
        if not self.upstreams:
            raise ConfigError("at least one upstream is needed")

    @property
    def listens(self) -> tuple[tuple[str, tuple[str, int] | None], ...]:
        """The addresses the workers share, by setting (None: not set)."""
        return ("proxy.listen", self.listen), ("proxy.admin_listen", self.admin_listen)


def load_proxy_config(path: str | os.PathLike[str]) -> ProxyConfig:
    """Read and validate a proxy TOML file (:class:`~geolimit.errors.ConfigError` naming key and file)."""
    data, file = load_toml(path)
    return parse_proxy_config(data, file)


def parse_proxy_config(data: Mapping[str, Any], path: Path | None = None) -> ProxyConfig:
    """A :class:`ProxyConfig` from the tables of a proxy TOML file (``path`` names it in errors)."""
    src = str(path) if path else "<config>"
    base = path.parent if path else Path.cwd()
    check_keys(data, {"proxy", "rule", "route", "log"}, src, "")
    proxy = get_table(data, "proxy", src, required=True)
    check_keys(proxy, _PROXY_KEYS, src, "proxy.")
    opts = _proxy_options(proxy, src)
    library = _mode(proxy, src, base, opts)
    rules: tuple[Rule, ...] = ()
    groups: dict[str, tuple[str, ...]] | None = None
    if library:
        if "rule" not in data:
            raise ConfigError(f"{src}: missing key rule: library mode (proxy.redis_url) needs [[rule]] tables "
                              f"(name, limit) for the routes' limits")
        tables = parse_rule_groups(data["rule"], src)
        rules = tuple(rule for group in tables.values() for rule in group)
        groups = {name: tuple(r.name for r in group) for name, group in tables.items()}
        groups.update({r.name: (r.name,) for r in rules})
    elif "rule" in data:
        raise ConfigError(f"{src}: unknown key 'rule': in agent mode (proxy.agent_url) the rules are the agent's; "
                          f"remove the [[rule]] tables")
    opts["routes"] = _routes(data.get("route", []), src, groups)
    opts["rules"] = rules
    opts.update(parse_log(get_table(data, "log", src), src))
    config = ProxyConfig(path=path, **opts)
    return with_workers(config, proxy["workers"], f"{src}: proxy.workers") if "workers" in proxy else config


def with_workers(config: ProxyConfig, workers: object, where: str = "--workers") -> ProxyConfig:
    """``config`` with ``workers`` processes, checked (``where`` names the setting in errors).

    From 1 to :data:`MAX_WORKERS`; several workers share the listen addresses
    (SO_REUSEPORT), so those need fixed ports.
    """
    count = check_workers(workers, where, config.listens)
    return replace(config, workers=count)


def _proxy_options(proxy: Mapping[str, Any], src: str) -> dict[str, Any]:
    """The ``[proxy]`` keys but the mode's (redis_url, agent_url, agent_token_file) as ProxyConfig fields."""
    opts: dict[str, Any] = {"upstreams": _upstreams(proxy, src)}
    if "listen" in proxy:
        opts["listen"] = parse_listen(proxy["listen"], f"{src}: proxy.listen")
    if "admin_listen" in proxy:
        opts["admin_listen"] = parse_listen(proxy["admin_listen"], f"{src}: proxy.admin_listen")
        listen = opts.get("listen", ("127.0.0.1", 8080))
        if opts["admin_listen"] == listen and listen[1] != 0:
            raise ConfigError(f"{src}: proxy.admin_listen must differ from proxy.listen ({listen[0]}:{listen[1]})")
    for key in ("connect_timeout", "timeout", "body_timeout", "shutdown_timeout", "decision_timeout"):
        if key in proxy:
            opts[key] = parse_seconds(proxy[key], src, f"proxy.{key}")
    for key in ("retry_connect", "preserve_host", "legacy_headers", "fast_path"):
        if key in proxy:
            opts[key] = require(proxy, key, bool, src, f"proxy.{key}")
    if "trusted_proxies" in proxy:
        opts["trusted_proxies"] = _trusted(proxy["trusted_proxies"], src)
    if "max_body" in proxy:
        opts["max_body"] = parse_positive_int(proxy["max_body"], src, "proxy.max_body")
    if "region" in proxy:
        opts["region"] = parse_region(proxy, "region", src, "proxy.region")
    if "key_prefix" in proxy:
        opts["key_prefix"] = require(proxy, "key_prefix", str, src, "proxy.key_prefix")
    if "shards" in proxy:
        opts["shards"] = parse_shards(proxy["shards"], src, "proxy.shards")
    return opts


def _mode(proxy: Mapping[str, Any], src: str, base: Path, opts: dict[str, Any]) -> bool:
    """Library mode (True) or agent mode (False); fills redis_url / agent_url / agent_token."""
    if ("redis_url" in proxy) == ("agent_url" in proxy):
        raise ConfigError(f"{src}: give exactly one of proxy.redis_url (decide in the region's Redis) and "
                          f"proxy.agent_url (ask the region's agent)")
    if "redis_url" in proxy:
        url = parse_redis_url(proxy, "redis_url", src, "proxy.redis_url")
        if "agent_token_file" in proxy:
            raise ConfigError(f"{src}: proxy.agent_token_file is only used with proxy.agent_url")
        if "region" not in opts:
            raise ConfigError(f"{src}: missing key proxy.region (library mode writes this region's counts)")
        opts["redis_url"] = url
        return True
    opts["agent_url"] = _http_url(require(proxy, "agent_url", str, src, "proxy.agent_url"), src, "proxy.agent_url")
    if "agent_token_file" in proxy:
        token_file = resolve_path(base, require(proxy, "agent_token_file", str, src, "proxy.agent_token_file"))
        opts["agent_token"] = read_token(token_file, src, "proxy.agent_token_file")
    for key in ("key_prefix", "shards"):
        if key in proxy:
            raise ConfigError(f"{src}: proxy.{key} is only used with proxy.redis_url (the agent has its own)")
    return False


def _http_url(url: str, src: str, where: str) -> str:
    parts = http_url_parts(url)
    if (parts is None or parts.query or parts.fragment or parts.path not in ("", "/")
            or parts.username or parts.password):
        raise ConfigError(f"{src}: {where} must be an http:// or https:// URL without a path, "
                          f"such as 'http://127.0.0.1:9000', got {url!r}")
    return url.rstrip("/")


def _upstreams(proxy: Mapping[str, Any], src: str) -> tuple[str, ...]:
    raw = require(proxy, "upstreams", list, src, "proxy.upstreams")
    if not raw:
        raise ConfigError(f"{src}: proxy.upstreams must list at least one URL")
    out: list[str] = []
    for i, url in enumerate(raw):
        if not isinstance(url, str):
            raise ConfigError(f"{src}: proxy.upstreams[{i}] must be a string, got {url!r}")
        url = _http_url(url, src, f"proxy.upstreams[{i}]")
        if url in out:
            raise ConfigError(f"{src}: proxy.upstreams[{i}]: duplicate upstream {url!r}")
        out.append(url)
    return tuple(out)


def _trusted(raw: object, src: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ConfigError(f"{src}: proxy.trusted_proxies must be a list of addresses or CIDRs, got {raw!r}")
    try:
        trusted_networks(raw)
    except ConfigError as exc:
        raise ConfigError(f"{src}: proxy.trusted_proxies: {exc}") from None
    return tuple(cast(list[str], raw))


def _routes(raw: object, src: str, rules: Mapping[str, tuple[str, ...]] | None) -> tuple[RoutePolicy, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{src}: routes are [[route]] tables")
    out: list[RoutePolicy] = []
    for i, item in enumerate(raw):
        where = f"route[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{src}: {where} must be a table")
        check_keys(item, _ROUTE_KEYS, src, where + ".")
        template = require(item, "path", str, src, f"{where}.path")
        methods = None
        if "methods" in item:
            methods = _methods(item["methods"], src, f"{where}.methods")
        try:
            route = Route(template, methods)
        except ConfigError as exc:
            raise ConfigError(f"{src}: {where}.path: {exc}") from None
        limits = item.get("limits", [])
        if not isinstance(limits, list):
            raise ConfigError(f"{src}: {where}.limits must be a list of {{ rule = ..., key = ... }} tables")
        specs = tuple(spec for j, x in enumerate(limits) for spec in _limit(x, src, f"{where}.limits[{j}]", rules))
        out.append(RoutePolicy(route, specs))
    return tuple(out)


def _methods(raw: object, src: str, where: str) -> frozenset[str]:
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) and m for m in raw):
        raise ConfigError(f"{src}: {where} must be a non-empty list of method names, got {raw!r}")
    methods = frozenset(m.upper() for m in cast(Sequence[str], raw))
    for method in methods:
        if not set(method) <= _METHOD_CHARS:
            raise ConfigError(f"{src}: {where}: invalid method {method!r}")
    return methods


def _limit(item: object, src: str, where: str, rules: Mapping[str, tuple[str, ...]] | None) -> list[LimitSpec]:
    """The limits of one ``limits`` entry: one per rule its name stands for (several for ``"10/hour;5/minute"``)."""
    if not isinstance(item, Mapping):
        raise ConfigError(f"{src}: {where} must be a table such as {{ rule = \"api\", key = \"ip\" }}")
    check_keys(item, _LIMIT_KEYS, src, where + ".")
    rule = require(item, "rule", str, src, f"{where}.rule")
    if rules is not None and rule not in rules:
        known = ", ".join(sorted(rules)) or "none"
        raise ConfigError(f"{src}: {where}.rule: unknown rule {rule!r}; [[rule]] tables define: {known}")
    names = (rule,) if rules is None else rules[rule]
    try:
        key = KeySpec(require(item, "key", str, src, f"{where}.key")) if "key" in item else KeySpec("ip")
    except ConfigError as exc:
        raise ConfigError(f"{src}: {where}.key: {exc}") from None
    cost_raw = item.get("cost", 1)
    try:
        cost = CostSpec(cost_raw)
    except ConfigError as exc:
        raise ConfigError(f"{src}: {where}.cost: {exc}") from None
    shadow = require(item, "shadow", bool, src, f"{where}.shadow") if "shadow" in item else False
    on_error = item.get("on_error", "allow")
    if on_error not in ("allow", "deny"):
        raise ConfigError(f"{src}: {where}.on_error must be 'allow' (fail open) or 'deny' (fail closed), "
                          f"got {on_error!r}")
    return [LimitSpec(name, key, cost, shadow, cast(Literal["allow", "deny"], on_error)) for name in names]


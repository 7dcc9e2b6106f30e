"""Agent configuration from TOML, validated strictly.

Every error names the key and the file. See ``deploy/`` and the README for
complete examples; the minimal file is::

    [region]
    name = "us-east"
    redis_url = "redis://127.0.0.1:6379/0"
    listen = "127.0.0.1:7400"
    secret_file = "gossip.key"

    [gossip]
    interval = 0.1
    peers = [ { name = "eu-west", url = "http://127.0.0.1:7401" } ]

    [[rule]]
    name = "api"
    limit = "1000/10s"
    resolution = 1
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from geolimit.core.rule import Rule
from geolimit.errors import ConfigError
from geolimit.server.admission import DEFAULT_MAX_CHECKS
from geolimit.server.rls.descriptors import RlsConfig
from geolimit.toml_config import (
    LOG_KEYS,
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
    read_secret,
    read_token,
    require,
    resolve_path,
)

__all__ = ["MAX_REDIS_TIMEOUT", "MAX_WORKERS", "AgentConfig", "PeerConfig", "TLSConfig", "load_config",
           "parse_config", "with_workers"]

_SECTIONS = {
    "region": {"name", "redis_url", "listen", "secret_file", "key_prefix", "shards", "on_error", "api_listen", "api_token_file",
               "redis_timeout", "workers", "rls_listen", "rls_config", "rls_fast_path", "rls_request_timeout",
               "rls_idle_timeout", "head_timeout", "max_connections", "max_checks_in_progress"},
    "gossip": {"interval", "peers", "anti_entropy_interval", "max_message_bytes", "max_backoff", "timeout",
               "outbox_limit", "auth_window", "tls"},
    "log": LOG_KEYS,
}
_PEER_KEYS = {"name", "url"}
_TLS_KEYS = {"cert_file", "key_file", "ca_file", "verify_peers"}
#: The longest region.redis_timeout accepted, in seconds.
MAX_REDIS_TIMEOUT = 60.0
#: The longest region.head_timeout accepted, in seconds.
MAX_HEAD_TIMEOUT = 300.0
#: The longest region.rls_request_timeout accepted, in seconds.
MAX_RLS_REQUEST_TIMEOUT = 300.0


@dataclass(frozen=True)
class PeerConfig:
    name: str
    url: str


@dataclass(frozen=True)
class TLSConfig:
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    verify_peers: bool = True

    def server_context(self) -> ssl.SSLContext | None:
        if self.cert_file is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if not self.verify_peers:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


@dataclass(frozen=True)
class AgentConfig:
    region: str
    redis_url: str
    listen: tuple[str, int]
    secret: bytes = field(repr=False)
    peers: tuple[PeerConfig, ...]
    rules: tuple[Rule, ...]
    interval: float = 0.1
    anti_entropy_interval: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    max_backoff: float | None = None  # default: twice the gossip interval
    timeout: float = 5.0
    outbox_limit: int = 1_000_000
    auth_window: float = 30.0
    key_prefix: str = "gl"
    shards: int = 64
    on_error: str = "raise"
    redis_timeout: float = 1.0  # seconds: socket timeout of the agent's Redis calls
    api_listen: tuple[str, int] | None = None
    api_token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = None
    workers: int = 1  # agent worker processes of this region (geolimit/server/workers.py)
    rls_listen: tuple[str, int] | None = None  # Envoy rate limit service (gRPC); None: off
    rls: RlsConfig | None = field(default=None, repr=False)  # its domains (their rules are in ``rules``)
    rls_fast_path: bool = True  # serve RLS with geolimit/server/rls/h2c.py (False: grpcio's core)
    #: Seconds from an RLS request's HEADERS to the end of its stream (fast path); SIGHUP applies it.
    rls_request_timeout: float = 10.0
    #: Seconds an RLS connection with no open stream may go without a frame before GOAWAY and close
    #: (fast path; longer than Envoy's 1 h upstream idle_timeout, docs/design.md); SIGHUP applies it.
    rls_idle_timeout: float = 3900.0
    #: Seconds a connection to the HTTP listeners has to send a request head (from its accept, or
    #: from a later request's first byte); SIGHUP applies it (geolimit/http/connections.py).
    head_timeout: float = 10.0
    #: Open connections each HTTP listener accepts; None: a share of RLIMIT_NOFILE. SIGHUP applies it.
    max_connections: int | None = None
    #: Checks (/v1/check, /v1/peek; a batch counts each) one agent process decides at once; one
    #: more is answered 503 with Retry-After (geolimit/server/admission.py). SIGHUP applies it.
    max_checks_in_progress: int = DEFAULT_MAX_CHECKS
    log_format: str = "text"
    log_level: str = "INFO"
    path: Path | None = None
    #: The ``[[rule]]`` tables whose limit holds several rates, by the table's name: ``api`` ->
    #: ``("api.1h", "api.1m")``. The decision API takes such a name for all of them (all-or-nothing).
    rule_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)


def load_config(path: str | os.PathLike[str]) -> AgentConfig:
    """Read and validate an agent TOML file."""
    data, file = load_toml(path)
    return parse_config(data, file)


def parse_config(data: Mapping[str, Any], path: Path | None = None) -> AgentConfig:
    """An :class:`AgentConfig` from the tables of an agent TOML file (``path`` names it in errors)."""
    src = str(path) if path else "<config>"
    base = path.parent if path else Path.cwd()
    check_keys(data, {"region", "gossip", "rule", "log"}, src, "")
    region = get_table(data, "region", src, required=True)
    gossip = get_table(data, "gossip", src, required=True)
    logs = get_table(data, "log", src)
    for name, table in (("region", region), ("gossip", gossip), ("log", logs)):
        check_keys(table, _SECTIONS[name], src, name + ".")
    name = parse_region(region, "name", src, "region.name")
    secret = read_secret(resolve_path(base, require(region, "secret_file", str, src, "region.secret_file")), src)
    redis_url = parse_redis_url(region, "redis_url", src, "region.redis_url")
    if "listen" not in region:
        raise ConfigError(f"{src}: missing key region.listen")
    listen = parse_listen(region["listen"], f"{src}: region.listen")
    peers = parse_peers(gossip, src, name)
    if "rule" not in data and "rls_config" not in region:
        raise ConfigError(f"{src}: missing key rule: define at least one [[rule]] table (name, limit)")
    tables = parse_rule_groups(data.get("rule", []), src)
    rules = tuple(rule for group in tables.values() for rule in group)
    groups = {table: tuple(r.name for r in group) for table, group in tables.items() if len(group) > 1}
    opts = _gossip_options(gossip, src, base)
    for i, peer in enumerate(peers):
        if "tls" in opts and not peer.url.lower().startswith("https://"):
            raise ConfigError(f"{src}: gossip.peers[{i}].url: [gossip.tls] is set but {peer.url!r} is plain http: "
                              "its messages would go in plaintext; use https://")
    opts.update(_region_options(region, src, base, listen))
    opts.update(parse_log(logs, src))
    if _RLS_KEYS & region.keys():
        rls_listen, rls = _parse_rls(region, src, base, rules)
        opts.update(rls_listen=rls_listen, rls=rls)
        if "rls_fast_path" in region:
            opts["rls_fast_path"] = require(region, "rls_fast_path", bool, src, "region.rls_fast_path")
        if "rls_request_timeout" in region:
            opts["rls_request_timeout"] = parse_seconds(region["rls_request_timeout"], src, "region.rls_request_timeout",
                                                     MAX_RLS_REQUEST_TIMEOUT)
        if "rls_idle_timeout" in region:
            opts["rls_idle_timeout"] = parse_seconds(region["rls_idle_timeout"], src, "region.rls_idle_timeout")
        rules += rls.rules
    config = AgentConfig(region=name, redis_url=redis_url, listen=listen, secret=secret, peers=peers, rules=rules,
                         path=path, rule_groups=groups, **opts)
    return with_workers(config, region["workers"], f"{src}: region.workers") if "workers" in region else config


#: Bounds of the [gossip] durations that have one: a round every microsecond busy-loops the
#: agent, and an auth window of years turns the clock check (and replay bounds) off.
_GOSSIP_SECONDS = {"interval": (0.001, 3600.0), "auth_window": (1.0, 3600.0)}


def _gossip_options(gossip: Mapping[str, Any], src: str, base: Path) -> dict[str, Any]:
    """The optional keys of ``[gossip]`` (all but ``peers``) as :class:`AgentConfig` fields."""
    opts: dict[str, Any] = {}
    for key in ("interval", "anti_entropy_interval", "max_backoff", "timeout", "auth_window"):
        if key in gossip:
            opts[key] = parse_seconds(gossip[key], src, f"gossip.{key}")
            low, high = _GOSSIP_SECONDS.get(key, (0.0, math.inf))
            if not low <= opts[key] <= high:
                raise ConfigError(f"{src}: gossip.{key} must be between {low:g} s and {high:g} s, "
                                  f"got {opts[key]:g} s")
    for key in ("max_message_bytes", "outbox_limit"):
        if key in gossip:
            opts[key] = parse_positive_int(gossip[key], src, f"gossip.{key}")
    if "tls" in gossip:
        opts["tls"] = parse_tls(gossip["tls"], src, base)
    return opts


def _region_options(region: Mapping[str, Any], src: str, base: Path, listen: tuple[str, int]) -> dict[str, Any]:
    """The optional keys of ``[region]`` (but the workers and the rate limit service) as AgentConfig fields."""
    opts: dict[str, Any] = {}
    if "key_prefix" in region:
        opts["key_prefix"] = require(region, "key_prefix", str, src, "region.key_prefix")
    if "shards" in region:
        opts["shards"] = parse_shards(region["shards"], src, "region.shards")
    if "on_error" in region:
        value = require(region, "on_error", str, src, "region.on_error")
        if value not in ("raise", "allow", "deny"):
            raise ConfigError(f"{src}: region.on_error must be 'raise', 'allow' or 'deny', got {value!r}")
        opts["on_error"] = value
    if "redis_timeout" in region:
        opts["redis_timeout"] = parse_seconds(region["redis_timeout"], src, "region.redis_timeout", MAX_REDIS_TIMEOUT)
    if "api_listen" in region:
        opts["api_listen"] = parse_listen(region["api_listen"], f"{src}: region.api_listen")
        if opts["api_listen"] == listen and listen[1] != 0:
            raise ConfigError(f"{src}: region.api_listen must differ from region.listen ({listen[0]}:{listen[1]})")
    if "head_timeout" in region:
        opts["head_timeout"] = parse_seconds(region["head_timeout"], src, "region.head_timeout", MAX_HEAD_TIMEOUT)
    if "max_connections" in region:
        opts["max_connections"] = parse_positive_int(region["max_connections"], src, "region.max_connections")
    if "max_checks_in_progress" in region:
        opts["max_checks_in_progress"] = parse_positive_int(region["max_checks_in_progress"], src,
                                                            "region.max_checks_in_progress")
    if "api_token_file" in region:
        token_file = resolve_path(base, require(region, "api_token_file", str, src, "region.api_token_file"))
        opts["api_token"] = read_token(token_file, src, "region.api_token_file")
    return opts


def with_workers(config: AgentConfig, workers: object, where: str = "--workers") -> AgentConfig:
    """``config`` with ``workers`` worker processes, checked (``where`` names the setting in errors).

    From 1 to :data:`MAX_WORKERS`, at most one per shard; several workers share the
    listen addresses (SO_REUSEPORT), so those need fixed ports.
    """
    count = check_workers(workers, where, (("region.listen", config.listen), ("region.api_listen", config.api_listen),
                                           ("region.rls_listen", config.rls_listen)))
    if count > config.shards:
        raise ConfigError(f"{where} = {count} exceeds region.shards = {config.shards}: every worker owns "
                          f"at least one shard")
    return replace(config, workers=count)


_RLS_KEYS = {"rls_listen", "rls_config", "rls_fast_path", "rls_request_timeout", "rls_idle_timeout"}


def _parse_rls(region: Mapping[str, Any], src: str, base: Path,
               rules: tuple[Rule, ...]) -> tuple[tuple[str, int], RlsConfig]:
    """``region.rls_listen`` (``"host:port"``, or a bare port on 127.0.0.1) and the ``region.rls_config`` files."""
    if "rls_listen" not in region and "rls_config" not in region:
        key = min(_RLS_KEYS & region.keys())
        raise ConfigError(f"{src}: region.{key} needs region.rls_listen and region.rls_config "
                          "(the Envoy rate limit service is off without them)")
    for key, other in (("rls_listen", "rls_config"), ("rls_config", "rls_listen")):
        if key not in region:
            raise ConfigError(f"{src}: region.{other} needs region.{key} (the Envoy rate limit service "
                              f"takes both: where to listen and the descriptor file)")
    listen = parse_listen(region["rls_listen"], f"{src}: region.rls_listen")
    files = region["rls_config"]
    names = [files] if isinstance(files, str) else files
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{src}: region.rls_config must be a file or directory name, or a list of them, "
                          f"such as 'ratelimit.yaml'; got {files!r}")
    from geolimit.server.rls.loading import load_rls

    try:
        rls = load_rls([resolve_path(base, n) for n in names], [r.name for r in rules])
    except ConfigError as exc:
        raise ConfigError(f"{src}: region.rls_config: {exc}") from None
    return listen, rls


def parse_peers(gossip: Mapping[str, Any], src: str, own: str) -> tuple[PeerConfig, ...]:
    raw = gossip.get("peers", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{src}: gossip.peers must be a list of {{ name = ..., url = ... }} tables")
    peers: list[PeerConfig] = []
    for i, item in enumerate(raw):
        where = f"gossip.peers[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{src}: {where} must be a table with name and url")
        check_keys(item, _PEER_KEYS, src, where + ".")
        name = parse_region(item, "name", src, f"{where}.name")
        url = require(item, "url", str, src, f"{where}.url")
        if name == own:
            raise ConfigError(f"{src}: {where}.name: a region cannot be its own peer ({name!r})")
        if any(p.name == name for p in peers):
            raise ConfigError(f"{src}: {where}.name: duplicate peer {name!r}")
        parts = http_url_parts(url)
        if parts is None or parts.query or parts.fragment:
            raise ConfigError(
                f"{src}: {where}.url must be an http:// or https:// URL such as 'https://10.0.0.2:7400', got {url!r}"
            )
        peers.append(PeerConfig(name, url))
    return tuple(peers)


def parse_tls(raw: object, src: str, base: Path) -> TLSConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{src}: gossip.tls must be a table")
    check_keys(raw, _TLS_KEYS, src, "gossip.tls.")
    files: dict[str, Path | None] = {}
    for key in ("cert_file", "key_file", "ca_file"):
        value = raw.get(key)
        if value is not None:
            path = resolve_path(base, require(raw, key, str, src, f"gossip.tls.{key}"))
            if not path.is_file():
                raise ConfigError(f"{src}: gossip.tls.{key}: {str(path)!r} does not exist")
            files[key] = path
    if ("cert_file" in files) != ("key_file" in files):
        raise ConfigError(f"{src}: gossip.tls needs both cert_file and key_file to serve TLS")
    verify = raw.get("verify_peers", True)
    if not isinstance(verify, bool):
        raise ConfigError(f"{src}: gossip.tls.verify_peers must be true or false, got {verify!r}")
    tls = TLSConfig(files.get("cert_file"), files.get("key_file"), files.get("ca_file"), verify)
    # Load the files now: a bad certificate or key is a config error, not a crash at startup.
    try:
        tls.server_context()
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(f"{src}: gossip.tls.cert_file/key_file: cannot load {str(tls.cert_file)!r}: {exc}") from None
    try:
        tls.client_context()
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(f"{src}: gossip.tls.ca_file: cannot load {str(tls.ca_file)!r}: {exc}") from None
    return tls

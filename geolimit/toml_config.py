"""Reading and checking TOML configuration files: what the agent's and the proxy's configs share.

Every function raises :class:`~geolimit.errors.ConfigError` with a message that
starts with the file (``src``) and names the key (``where``), such as
``agent.toml: gossip.interval must be a positive number of seconds ...``.
The app-specific parsers are :mod:`geolimit.server.config` (the agent) and
:mod:`geolimit.proxy.config` (the proxy); neither imports the other.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

from geolimit.core.keys import MAX_SHARDS
from geolimit.core.rule import Rule, parse_duration, parse_rates
from geolimit.errors import ConfigError, GeolimitError
from geolimit.limiter_base import validate_region
from geolimit.replication.auth import MIN_SECRET_BYTES
from geolimit.store.connect import split_cluster_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "LOG_KEYS", "MAX_WORKERS", "check_keys", "check_workers", "get_table", "load_toml", "parse_listen", "parse_log", "parse_positive_int",
    "parse_redis_url", "parse_region", "parse_rule_groups", "parse_rules", "parse_seconds", "parse_shards", "read_secret",
    "read_token", "require", "resolve_path",
]

#: The keys of a ``[log]`` table.
LOG_KEYS = {"format", "level"}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_RULE_KEYS = {"name", "limit", "window", "resolution", "mode", "predict", "partition", "partition_after", "escrow"}
#: Rule keys that do not apply to an escrow rule.
_NOT_ESCROW_KEYS = ("mode", "predict", "partition", "partition_after")


def load_toml(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """Read a TOML file; every failure is a ConfigError naming the file."""
    file = Path(path)
    try:
        return tomllib.loads(file.read_text(encoding="utf-8")), file
    except FileNotFoundError:
        raise ConfigError(f"config file {str(file)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(file)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: invalid TOML: {exc}") from None


def check_keys(table: Mapping[str, Any], allowed: set[str], src: str, where: str) -> None:
    """Refuse a key of ``table`` outside ``allowed`` (``where``: the table's dotted prefix, such as ``"region."``)."""
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{src}: unknown key {where + key!r}; allowed here: {', '.join(sorted(allowed))}")


def get_table(data: Mapping[str, Any], key: str, src: str, required: bool = False) -> Mapping[str, Any]:
    """The ``[key]`` table of ``data`` (empty when absent and not ``required``)."""
    if key not in data:
        if required:
            raise ConfigError(f"{src}: missing section [{key}]")
        return {}
    value = data[key]
    if not isinstance(value, Mapping):
        raise ConfigError(f"{src}: {key} must be a [{key}] table, got {value!r}")
    return value


def require(table: Mapping[str, Any], key: str, kind: type, src: str, where: str) -> Any:
    """``table[key]``, which must be present and a ``kind`` (a bool is not an int)."""
    if key not in table:
        raise ConfigError(f"{src}: missing key {where}")
    value = table[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{src}: {where} must be a {kind.__name__}, got {value!r}")
    return value


def parse_listen(value: object, where: str) -> tuple[str, int]:
    """A ``"host:port"`` address, or a bare port (a number or a string of digits) on 127.0.0.1
    (``where`` holds the file and the key)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= 65535:
            raise ConfigError(f"{where}: a port from 0 to 65535, got {value}")
        return "127.0.0.1", value
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{where}: expected 'host:port' (or a bare port, on 127.0.0.1), got {value!r}")
    host, _, port_s = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 address: [::1]:7400
    elif ":" in host:  # '::1' would read as host ':' and port 1
        raise ConfigError(f"{where}: an IPv6 address goes in brackets, '[::1]:7400', got {value!r}")
    if not (port_s.isascii() and port_s.isdigit()):  # int() takes '+80', ' 80', '8_0' and other scripts' digits
        raise ConfigError(f"{where}: port must be a number, got {port_s!r}")
    port = int(port_s)
    if not host or any(c.isspace() for c in host) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}: expected 'host:port' with a port from 0 to 65535, got {value!r}")
    return host, port


def parse_seconds(value: object, src: str, where: str, at_most: float | None = None) -> float:
    """A positive, finite number of seconds, or a duration string such as ``"10s"`` (``at_most``: its bound)."""
    if isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ConfigError as exc:
            raise ConfigError(f"{src}: {where}: {exc}") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{src}: {where} must be a positive number of seconds (or a duration such as '10s'), got {value!r}")
    else:
        seconds = float(value)
    if at_most is not None and seconds > at_most:
        raise ConfigError(f"{src}: {where} must be at most {at_most:g} seconds, got {value!r}")
    return seconds


def parse_positive_int(value: object, src: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{src}: {where} must be a positive integer, got {value!r}")
    return value


def parse_shards(value: object, src: str, where: str) -> int:
    """A shard count from 1 to :data:`~geolimit.core.keys.MAX_SHARDS` (``where`` names the setting)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SHARDS:
        raise ConfigError(f"{src}: {where} must be an integer from 1 to {MAX_SHARDS}, got {value!r}")
    return value


#: The most worker processes of one agent or proxy (``workers``, ``--workers``).
MAX_WORKERS = 64


def check_workers(workers: object, where: str, listens: Iterable[tuple[str, tuple[str, int] | None]]) -> int:
    """A worker count from 1 to :data:`MAX_WORKERS` (``where`` names the setting in errors).
    Several workers share the ``listens`` addresses (SO_REUSEPORT), so those need fixed ports."""
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"{where} must be an integer from 1 to {MAX_WORKERS}, got {workers!r}")
    if workers > 1:
        for key, address in listens:
            if address is not None and address[1] == 0:
                raise ConfigError(f"{where} = {workers} needs a fixed port in {key}: the workers share it "
                                  f"(SO_REUSEPORT), and with port 0 each would get a port of its own")
    return workers


def parse_region(table: Mapping[str, Any], key: str, src: str, where: str) -> str:
    """A region name (``table[key]``), checked as :func:`~geolimit.limiter_base.validate_region` does."""
    name: str = require(table, key, str, src, where)
    try:
        validate_region(name)
    except ConfigError as exc:
        raise ConfigError(f"{src}: {where}: {exc}") from None
    return name


def http_url_parts(url: str) -> SplitResult | None:
    """``url`` split, if it is an ``http://`` or ``https://`` URL with a host and a valid
    port (an unclosed IPv6 bracket or a port outside 0-65535 makes ``urlsplit`` or
    ``.port`` raise ``ValueError``); None otherwise. Callers add their own rules (no
    path, no query) and name the key in their error."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts


def parse_redis_url(table: Mapping[str, Any], key: str, src: str, where: str) -> str:
    """A Redis URL (``table[key]``): ``redis://``, ``rediss://``, ``unix://`` or a cluster URL."""
    url: str = require(table, key, str, src, where)
    try:
        split_cluster_url(url)
    except ConfigError as exc:
        raise ConfigError(f"{src}: {where}: {exc}") from None
    return url


def resolve_path(base: Path, value: str) -> Path:
    """``value`` (``~`` expanded), relative to ``base`` (the config file's directory) unless absolute."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def read_secret(path: Path, src: str, what: str = "region.secret_file") -> bytes:
    """The stripped contents of a secret file: at least MIN_SECRET_BYTES bytes (``what``: its key)."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{src}: {what}: cannot read {str(path)!r}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{src}: {what}: {str(path)!r} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            f"random bytes (for example: head -c 32 /dev/urandom | base64 > {path.name})"
        )
    return secret


def read_token(path: Path, src: str, what: str) -> str:
    """An API bearer token: at least MIN_SECRET_BYTES printable ASCII characters, no spaces."""
    raw = read_secret(path, src, what=what)
    if not all(0x21 <= b <= 0x7E for b in raw):
        raise ConfigError(
            f"{src}: {what}: {str(path)!r} must hold one line of printable ASCII without "
            f"spaces (it is sent as 'Authorization: Bearer <token>'; for example: "
            f"head -c 32 /dev/urandom | base64 > {path.name})"
        )
    return raw.decode("ascii")


def parse_log(logs: Mapping[str, Any], src: str) -> dict[str, str]:
    """The ``[log]`` table as ``log_format`` / ``log_level`` options (only the keys it gives)."""
    check_keys(logs, LOG_KEYS, src, "log.")
    out: dict[str, str] = {}
    if "format" in logs:
        fmt = require(logs, "format", str, src, "log.format")
        if fmt not in ("text", "json"):
            raise ConfigError(f"{src}: log.format must be 'text' or 'json', got {fmt!r}")
        out["log_format"] = fmt
    if "level" in logs:
        level = require(logs, "level", str, src, "log.level").upper()
        if level not in _LOG_LEVELS:
            raise ConfigError(f"{src}: log.level must be one of {', '.join(_LOG_LEVELS)} (any case), got {level!r}")
        out["log_level"] = level
    return out


def parse_rules(raw: object, src: str) -> tuple[Rule, ...]:
    """The rules of the ``[[rule]]`` tables; a table whose limit holds several rates gives several."""
    return tuple(rule for group in parse_rule_groups(raw, src).values() for rule in group)


def parse_rule_groups(raw: object, src: str) -> dict[str, tuple[Rule, ...]]:
    """The rules of each ``[[rule]]`` table, by the table's name.

    ``limit = "10/hour;5/minute"`` in table ``api`` gives the rules ``api.1h`` and
    ``api.1m`` (see :meth:`~geolimit.Rule.parse_many`); one rate keeps the name.
    """
    if not isinstance(raw, list):
        raise ConfigError(f"{src}: rules are [[rule]] tables")
    groups: dict[str, tuple[Rule, ...]] = {}
    rules: list[Rule] = []
    for i, item in enumerate(raw):
        name, new = _parse_rule_table(item, src, f"rule[{i}]")
        for rule in new:
            if name in groups or any(r.name == rule.name for r in rules):
                raise ConfigError(f"{src}: rule {name!r}: duplicate rule name "
                                  f"{name if name in groups else rule.name!r}")
            rules.append(rule)
        groups[name] = tuple(new)
    return groups


def _parse_rule_table(item: object, src: str, where: str) -> tuple[str, list[Rule]]:
    """One ``[[rule]]`` table (``where``: ``rule[i]``): its name and its rules."""
    if not isinstance(item, Mapping):
        raise ConfigError(f"{src}: {where} must be a table")
    check_keys(item, _RULE_KEYS, src, where + ".")
    name = require(item, "name", str, src, f"{where}.name")
    if "limit" not in item:
        raise ConfigError(f"{src}: missing key {where}.limit (rule {name!r}): a rate such as '1000/10s', "
                          f"or a number with window")
    where = f"rule {name!r}"
    limit = item["limit"]
    try:
        if isinstance(limit, str):
            if "window" in item:
                raise ConfigError(f"window is given twice: in limit {limit!r} and as window")
            rates = parse_rates(limit)
        elif isinstance(limit, int) and not isinstance(limit, bool):
            if "window" not in item:
                raise ConfigError("limit is a number, so window (seconds or '10s') is required")
            rates = [(limit, parse_seconds(item["window"], src, f"{where}.window"))]
        else:
            raise ConfigError(f"limit must be a rate string such as '1000/10s' or a number, got {limit!r}")
        resolution = item.get("resolution")
        if resolution is not None:
            resolution = parse_seconds(resolution, src, f"{where}.resolution")
        mode = item.get("mode", "strict")
        if mode not in ("strict", "approximate"):
            raise ConfigError(f"mode must be 'strict' or 'approximate', got {mode!r}")
        options: dict[str, Any] = {key: item[key] for key in ("predict", "partition", "escrow") if key in item}
        if item.get("escrow") is True:
            given = [key for key in _NOT_ESCROW_KEYS if key in item]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply to an escrow rule "
                    f"(escrow = true): remove {' and '.join(given)} or escrow"
                )
        if "partition_after" in item:
            options["partition_after"] = parse_seconds(item["partition_after"], src, f"{where}.partition_after")
        if len(rates) > 1:
            return name, Rule.parse_many(name, limit, resolution, mode, **options)
        return name, [Rule(name, rates[0][0], rates[0][1], resolution, mode, **options)]
    except GeolimitError as exc:
        detail = str(exc)
        if detail.startswith(f"{src}: "):  # parse_seconds named the file and the key already
            raise ConfigError(detail) from None
        # Rule() already names the rule ("rule 'api': ..."): do not say it twice.
        prefix = "" if detail.startswith(f"{where}:") else f"{where}: "
        raise ConfigError(f"{src}: {prefix}{detail}") from None

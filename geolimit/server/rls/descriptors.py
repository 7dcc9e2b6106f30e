"""Envoy rate limit service configuration: parsing and matching (no I/O).

The YAML shape is envoyproxy/ratelimit's, so an existing file works unchanged::

    domain: messaging
    descriptors:
      - key: message_type
        value: marketing
        descriptors:
          - key: to_number              # no value: one limit per distinct value
            rate_limit: {unit: day, requests_per_unit: 5}
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 100}
        shadow_mode: true               # counted and reported, never OVER_LIMIT
        detailed_metric: true           # metrics name the value, not only the key

``rate_limit`` takes ``unit`` (second, minute, hour, day, week, month = 30 days,
year = 365 days), ``requests_per_unit``, ``unlimited``, ``name`` and ``replaces``.
A value ending in ``*`` matches every value with that prefix.

Matching follows envoyproxy/ratelimit: entry by entry, the exact key/value is
tried first, then the wildcard values of that level in file order, then the key
alone; a limit applies only where the descriptor's last entry lands (a
descriptor with more or fewer entries than the configured depth gets no limit).

Every limited node becomes a geolimit :class:`~geolimit.Rule` named after its
path and unit (``messaging.to_number-per-day``), with the unit as its window;
the counter of one descriptor is that rule's key for the subject
:func:`subject_of` builds from all of the descriptor's entries, as the
reference service's cache key does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.core.rule import Rule
from geolimit.errors import ConfigError, GeolimitError

__all__ = ["UNITS", "UNIT_CODES", "Domain", "Limit", "Node", "RlsConfig", "match", "parse_rls", "subject_of"]

#: Seconds per unit, as envoyproxy/ratelimit counts them.
UNITS: dict[str, int] = {
    "second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400, "month": 30 * 86400,
    "year": 365 * 86400,
}
#: ``envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit`` values.
UNIT_CODES: dict[str, int] = {"second": 1, "minute": 2, "hour": 3, "day": 4, "month": 5, "year": 6, "week": 7}

_DOC_KEYS = frozenset({"domain", "descriptors"})
_DESCRIPTOR_KEYS = frozenset({"key", "value", "rate_limit", "descriptors", "shadow_mode", "detailed_metric"})
_LIMIT_KEYS = frozenset({"unit", "requests_per_unit", "unlimited", "name", "replaces"})
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.\-]")
_MAX_NAME = 64
_MAX_DEPTH = 32


@dataclass(frozen=True)
class Limit:
    """A configured limit: its geolimit rule (None when unlimited) and Envoy-facing settings."""

    full_key: str  # envoyproxy/ratelimit's name for the node: "domain.key_value.key"
    rule: Rule | None
    unit: str = "second"
    requests_per_unit: int = 0
    name: str = ""  # rate_limit.name, for replaces
    replaces: tuple[str, ...] = ()
    shadow: bool = False
    detailed_metric: bool = False

    @property
    def unlimited(self) -> bool:
        return self.rule is None


@dataclass(frozen=True)
class Node:
    """One level of a descriptor tree: what each entry key/value leads to."""

    limit: Limit | None = None
    exact: Mapping[tuple[str, str], Node] = field(default_factory=dict)
    wildcards: tuple[tuple[str, str, Node], ...] = ()  # (key, value prefix, node), in file order
    default: Mapping[str, Node] = field(default_factory=dict)  # key with no value: any value

    def step(self, key: str, value: str) -> Node | None:
        found = self.exact.get((key, value))
        if found is None and self.wildcards:
            for w_key, prefix, node in self.wildcards:
                if key == w_key and value.startswith(prefix):
                    return node
        return found if found is not None else self.default.get(key)


@dataclass(frozen=True)
class Domain:
    name: str
    root: Node
    source: str  # the file (and document) it came from


@dataclass(frozen=True)
class RlsConfig:
    """Every domain, and the geolimit rules their limits need."""

    domains: Mapping[str, Domain]
    rules: tuple[Rule, ...]
    sources: tuple[str, ...] = ()


def match(domain: Domain, entries: Sequence[tuple[str, str]]) -> Limit | None:
    """The limit for a descriptor's ``(key, value)`` entries, or None."""
    node: Node | None = domain.root
    last = len(entries) - 1
    for i, (key, value) in enumerate(entries):
        assert node is not None
        node = node.step(key, value)
        if node is None:
            return None
        if i == last:
            return node.limit
        if not (node.exact or node.wildcards or node.default):
            return None
    return None


def subject_of(entries: Sequence[tuple[str, str]]) -> bytes:
    """The subject of a descriptor's counter: ``key=value&key=value``, ``%``-escaped.

    Subjects longer than geolimit allows are replaced by a SHA-256 of themselves.
    """
    out = "&".join(f"{_escape(k)}={_escape(v)}" for k, v in entries).encode("utf-8", "surrogatepass")
    if len(out) > MAX_SUBJECT_BYTES:
        out = b"sha256:" + hashlib.sha256(out).hexdigest().encode()
    return out


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("&", "%26").replace("=", "%3D")


def parse_rls(documents: Sequence[tuple[str, object]], reserved: Sequence[str] = ()) -> RlsConfig:
    """Build the configuration from loaded YAML documents, each with its source name.

    ``reserved`` are rule names already taken (the agent's own ``[[rule]]`` tables).
    Errors are :class:`ConfigError` naming the source and the path in the document.
    """
    builder = _Builder(set(reserved))
    domains: dict[str, Domain] = {}
    for source, doc in documents:
        if doc is None:
            continue
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{source}: expected a mapping with 'domain' and 'descriptors', got {_show(doc)}")
        _check_keys(doc, _DOC_KEYS, source, "")
        name = doc.get("domain")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: domain: a non-empty string is required, got {_show(name)}")
        if name in domains:
            raise ConfigError(f"{source}: domain: {name!r} is defined twice (also in {domains[name].source})")
        root = builder.level(doc.get("descriptors"), source, "descriptors", name, 0, None)
        domains[name] = Domain(name, root, source)
    return RlsConfig(domains, tuple(builder.rules), tuple(s for s, _ in documents))


class _Builder:
    def __init__(self, reserved: set[str]) -> None:
        self.taken = reserved  # rule names in use: the agent's own, then each one made here
        self.rules: list[Rule] = []

    def level(self, items: object, source: str, where: str, parent: str, depth: int, limit: Limit | None) -> Node:
        """The node holding ``limit`` and the descriptors ``items`` under it."""
        if items is None or items == "":
            return Node(limit)
        if not isinstance(items, list):
            raise ConfigError(f"{source}: {where}: expected a list of descriptors, got {_show(items)}")
        if depth >= _MAX_DEPTH:
            raise ConfigError(f"{source}: {where}: descriptors nest deeper than {_MAX_DEPTH} levels")
        exact: dict[tuple[str, str], Node] = {}
        wildcards: list[tuple[str, str, Node]] = []
        default: dict[str, Node] = {}
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            if not isinstance(item, Mapping):
                raise ConfigError(f"{source}: {at}: expected a mapping with 'key', got {_show(item)}")
            _check_keys(item, _DESCRIPTOR_KEYS, source, at + ".")
            key = _text(item.get("key"), source, at + ".key", required=True)
            value = _text(item.get("value"), source, at + ".value")
            full_key = f"{parent}.{key}_{value}" if value else f"{parent}.{key}"
            if (value and (key, value) in exact) or (not value and key in default) or \
                    any(w[0] == key and w[1] + "*" == value for w in wildcards):
                raise ConfigError(f"{source}: {at}: duplicate descriptor {full_key!r} at this level")
            node = self.level(item.get("descriptors"), source, at + ".descriptors", full_key, depth + 1,
                              self.limit(item, source, at, full_key))
            if not value:
                default[key] = node
            elif value.endswith("*"):
                wildcards.append((key, value[:-1], node))
            else:
                exact[(key, value)] = node
        return Node(limit, exact, tuple(wildcards), default)

    def limit(self, item: Mapping[str, object], source: str, at: str, full_key: str) -> Limit | None:
        shadow = _flag(item.get("shadow_mode"), source, at + ".shadow_mode")
        detailed = _flag(item.get("detailed_metric"), source, at + ".detailed_metric")
        raw = item.get("rate_limit")
        if raw is None:
            return None
        at += ".rate_limit"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: {at}: expected a mapping with unit and requests_per_unit, got {_show(raw)}")
        _check_keys(raw, _LIMIT_KEYS, source, at + ".")
        name = _text(raw.get("name"), source, at + ".name")
        replaces = self.replaces(raw.get("replaces"), source, at + ".replaces", name)
        unit = _text(raw.get("unit"), source, at + ".unit").lower()
        if _flag(raw.get("unlimited"), source, at + ".unlimited"):
            if unit:
                raise ConfigError(f"{source}: {at}: an unlimited rate_limit takes no unit")
            return Limit(full_key, None, name=name, replaces=replaces, shadow=shadow, detailed_metric=detailed)
        if unit not in UNITS:
            raise ConfigError(f"{source}: {at}.unit: {'missing' if not unit else repr(unit)}; "
                              f"use one of {', '.join(UNITS)} (or unlimited: true)")
        count = _count(raw.get("requests_per_unit"), source, at + ".requests_per_unit")
        rule_name = self.rule_name(f"{full_key}-per-{unit}", source, at)
        try:
            rule = Rule(rule_name, count, UNITS[unit])
        except GeolimitError as exc:
            raise ConfigError(f"{source}: {at}: {exc}") from None
        self.rules.append(rule)
        return Limit(full_key, rule, unit, count, name, replaces, shadow, detailed)

    def replaces(self, raw: object, source: str, at: str, own: str) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            raise ConfigError(f"{source}: {at}: expected a list of {{name: ...}}, got {_show(raw)}")
        names: list[str] = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{source}: {at}[{i}]: expected a mapping with name, got {_show(entry)}")
            _check_keys(entry, frozenset({"name"}), source, f"{at}[{i}].")
            name = _text(entry.get("name"), source, f"{at}[{i}].name", required=True)
            if name == own:
                raise ConfigError(f"{source}: {at}[{i}].name: a limit cannot replace itself ({name!r})")
            names.append(name)
        return tuple(names)

    def rule_name(self, wanted: str, source: str, at: str) -> str:
        name = _NOT_NAME.sub("_", wanted)
        if len(name) > _MAX_NAME or name in self.taken:
            digest = hashlib.sha1(wanted.encode("utf-8", "surrogatepass")).hexdigest()[:8]
            name = f"{name[: _MAX_NAME - 9]}-{digest}"
        if name in self.taken:  # pragma: no cover - a SHA-1 prefix collision
            raise ConfigError(f"{source}: {at}: rule name {name!r} is taken twice")
        self.taken.add(name)
        return name


def _check_keys(table: Mapping[object, object], allowed: frozenset[str], source: str, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{source}: unknown key {where}{key}; allowed here: {', '.join(sorted(allowed))}")


def _text(value: object, source: str, where: str, required: bool = False) -> str:
    if value is None:
        value = ""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{source}: {where}: expected a string, got {_show(value)} (quote it)")
    text = str(value)
    if required and not text:
        raise ConfigError(f"{source}: {where}: a non-empty string is required")
    return text


def _flag(value: object, source: str, where: str) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    raise ConfigError(f"{source}: {where}: expected true or false, got {_show(value)}")


def _count(value: object, source: str, where: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if value is None:
        raise ConfigError(f"{source}: {where}: missing (a whole number of requests per unit)")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**32 - 1:
        raise ConfigError(f"{source}: {where}: expected a whole number from 0 to 4294967295, got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""Who is limited and how much a request costs: shared by the proxy and the middlewares.

Framework-neutral: each integration turns its request into a :class:`RequestInfo`.

**Key specs** are ``+``-joined parts, each one of:

* ``ip``: the client address, resolved through trusted proxies (below);
* ``header:NAME``: a request header's value (for example an API key);
* ``path``: the route's path template (so ``/users/{id}`` limits all users together);
* ``param:NAME``: a path template parameter (``/users/{id}`` and ``param:id``);
* ``method``: the request method;
* ``const:TEXT``: a fixed text (one global bucket).

A missing header or parameter contributes ``-``: all such requests share a bucket.

**Cost specs**: an integer, ``header:NAME`` (an integer header, 0 if absent) or
``body`` (the request's ``Content-Length``, for byte quotas).

**Client address**: the peer address, unless the peer is a trusted proxy; then
``Forwarded`` (RFC 7239, preferred) or ``X-Forwarded-For`` is read from the
right, skipping trusted proxies, and the first untrusted address is the client.
Untrusted peers cannot spoof their address with these headers.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from geolimit.core.keys import MAX_SUBJECT_BYTES
from geolimit.errors import ConfigError, RequestError

__all__ = [
    "CostSpec", "KeySpec", "RequestInfo", "Route", "bounded_subject", "client_address", "parse_forwarded",
    "trusted_networks",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class RequestInfo:
    """What limiting needs to know about a request."""

    method: str
    path: str
    headers: Mapping[str, str]  # case-insensitive lookup expected (use lower-case names)
    peer: str | None  # the TCP peer's address
    content_length: int | None = None

    def header(self, name: str) -> str | None:
        value = self.headers.get(name)
        if value is None:
            value = self.headers.get(name.lower())
        return value


def trusted_networks(specs: Iterable[str]) -> tuple[Network, ...]:
    out = []
    for spec in specs:
        try:
            out.append(ipaddress.ip_network(spec, strict=False))
        except ValueError:
            raise ConfigError(f"invalid trusted proxy {spec!r}: expected an address or CIDR") from None
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a peer or a forwarding header names it (cached: the same few peers come back)."""
    text = text.strip().strip('"')
    if text.startswith("["):  # [v6]:port or [v6]
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


_FOR_RE = re.compile(r'(?:^|;)\s*for\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]+)', re.IGNORECASE)


def parse_forwarded(values: Sequence[str]) -> list[str]:
    """The ``for=`` addresses of ``Forwarded`` header values, in order (RFC 7239)."""
    out: list[str] = []
    for value in values:
        for element in value.split(","):
            match = _FOR_RE.search(element)
            if match:
                out.append(match.group(1).strip('"'))
    return out


def _trusted(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, trusted: Sequence[Network]) -> bool:
    return bool(trusted) and any(addr in net for net in trusted)


@functools.lru_cache(maxsize=4096)
def _peer_text(text: str) -> str:
    """The address that a peer's text names, written as ``str()`` writes it (cached by the text: an
    address object's hash is computed in Python every time)."""
    return str(_address(text))


def client_address(request: RequestInfo, trusted: Sequence[Network]) -> str:
    """The client's address (see the module docstring); ``unknown`` if none can be read."""
    text = request.peer
    if not text:
        return "unknown"
    peer = _address(text)
    if peer is None:
        return text
    if not _trusted(peer, trusted):
        return _peer_text(text)
    forwarded = request.header("forwarded")
    chain = parse_forwarded([forwarded]) if forwarded else []
    if not chain:
        xff = request.header("x-forwarded-for")
        chain = [part for part in (xff or "").split(",") if part.strip()]
    client = peer
    for hop in reversed(chain):
        addr = _address(hop)
        if addr is None:
            break  # "unknown", an obfuscated identifier or garbage: stop at the last good address
        client = addr
        if not _trusted(addr, trusted):
            break
    return str(client)


_PART_RE = re.compile(r"^(ip|path|method|header:[!#$%&'*+.^_`|~0-9A-Za-z-]+|param:[A-Za-z_][A-Za-z0-9_]*|const:.+)$")


@dataclass(frozen=True)
class KeySpec:
    """How to build the limited subject from a request, e.g. ``"ip+header:X-API-Key"``."""

    text: str
    parts: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = tuple(p.strip() for p in self.text.split("+")) if isinstance(self.text, str) else ()
        if not parts or not all(_PART_RE.match(p) for p in parts):
            raise ConfigError(
                f"invalid key {self.text!r}: use ip, path, method, header:NAME, param:NAME or const:TEXT, "
                f"joined with +"
            )
        object.__setattr__(self, "parts", parts)

    def subject(self, request: RequestInfo, params: Mapping[str, str], template: str, trusted: Sequence[Network]) -> str:
        values = []
        for part in self.parts:
            if part == "ip":
                values.append("ip=" + client_address(request, trusted))
            elif part == "path":
                values.append("path=" + template)
            elif part == "method":
                values.append("method=" + request.method.upper())
            elif part.startswith("header:"):
                name = part[7:]
                values.append(f"{name.lower()}=" + (request.header(name.lower()) or "-"))
            elif part.startswith("param:"):
                values.append(f"{part[6:]}=" + params.get(part[6:], "-"))
            else:
                values.append(part)
        return "|".join(values)


@dataclass(frozen=True)
class CostSpec:
    """A request's cost: ``1``, ``"header:X-Cost"`` or ``"body"``."""

    spec: int | str = 1

    def __post_init__(self) -> None:
        spec = self.spec
        if isinstance(spec, bool) or not (
            (isinstance(spec, int) and spec >= 0)
            or spec == "body"
            or (isinstance(spec, str) and re.match(r"^header:[!#$%&'*+.^_`|~0-9A-Za-z-]+$", spec))
        ):
            raise ConfigError(f"invalid cost {spec!r}: use an integer >= 0, 'body' or 'header:NAME'")

    def cost(self, request: RequestInfo) -> int:
        """The cost; :class:`~geolimit.errors.RequestError` if the request's header or body size is unusable."""
        spec = self.spec
        if isinstance(spec, int):
            return spec
        if spec == "body":
            if request.content_length is None:
                raise RequestError("a byte-quota route needs a Content-Length")
            return request.content_length
        raw = request.header(spec[7:].lower())
        if raw is None:
            return 0
        try:
            value = int(raw.strip())
        except ValueError:
            raise RequestError(f"{spec[7:]} must be an integer, got {raw[:64]!r}") from None
        if value < 0:
            raise RequestError(f"{spec[7:]} must not be negative")
        return value


_PARAM_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Route:
    """A path template (``/users/{id}``, ``/static/*``) and optional methods.

    Only a trailing ``*`` is a wildcard (any rest of the path, ``/`` included); a
    ``*`` anywhere else (``/api/**``, ``/v/*.html``) is a :class:`ConfigError`.
    """

    template: str
    methods: frozenset[str] | None = None
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template.startswith("/"):
            raise ConfigError(f"invalid route {self.template!r}: it must be a path that starts with /")
        if "*" in self.template[:-1]:
            raise ConfigError(
                f"invalid route {self.template!r}: only a trailing * is a wildcard ('/static/*' matches every "
                f"path under /static/, subfolders too); a * anywhere else would match only a literal *, "
                f"so the route would limit nothing"
            )
        names = _PARAM_RE.findall(self.template)
        if len(set(names)) != len(names):
            raise ConfigError(f"invalid route {self.template!r}: each {{name}} may appear once")
        regex = ""
        pos = 0
        for match in _PARAM_RE.finditer(self.template):
            regex += re.escape(self.template[pos : match.start()]) + f"(?P<{match.group(1)}>[^/]+)"
            pos = match.end()
        tail = self.template[pos:]
        if tail.endswith("*"):
            regex += re.escape(tail[:-1]) + ".*"
        else:
            regex += re.escape(tail)
        # DOTALL: a trailing * covers every character, a newline too (a path with %0A in it
        # matched no '/*' route before, so it went through unlimited).
        object.__setattr__(self, "pattern", re.compile("^" + regex + "$", re.DOTALL))

    def match(self, method: str, path: str) -> dict[str, str] | None:
        if self.methods is not None and method.upper() not in self.methods:
            return None
        found = self.pattern.match(path)
        return None if found is None else found.groupdict()


def bounded_subject(subject: str | bytes) -> str | bytes:
    """``subject``, or ``"sha256:<hex>"`` of its bytes when it is too long for the limiter.

    A huge key header (an API key of 5 kB) still gets a stable bucket of its own.
    Header bytes that are not UTF-8 (kept by aiohttp as surrogates) are used raw.
    """
    if isinstance(subject, str):
        if subject.isascii() and len(subject) <= MAX_SUBJECT_BYTES:
            return subject
        try:
            raw = subject.encode("utf-8")
        except UnicodeEncodeError:
            raw = subject.encode("utf-8", "surrogateescape")
            subject = raw
    else:
        raw = subject
    if len(raw) > MAX_SUBJECT_BYTES:
        return "sha256:" + hashlib.sha256(raw).hexdigest()
    return subject

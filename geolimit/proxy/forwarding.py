"""Headers between client, proxy and upstream (no I/O).

* Hop-by-hop headers are never forwarded, in either direction: ``Connection``,
  ``Keep-Alive``, ``Proxy-*``, ``TE``, ``Trailer``, ``Transfer-Encoding``,
  ``Upgrade`` and every header that ``Connection`` names. ``Expect`` is answered
  by the proxy itself (after the rate-limit decision), so it is not forwarded either.
* ``X-Forwarded-For``, ``X-Forwarded-Proto``, ``X-Forwarded-Host`` and
  ``Forwarded`` (RFC 7239) are *rebuilt*: when the TCP peer is a trusted proxy,
  its values are kept and this hop is appended; from any other peer they are
  dropped and the chain starts at the peer, so an untrusted client cannot
  inject addresses that the upstream would believe.
* ``Host`` is the upstream's own ``host[:port]`` unless ``preserve_host``; the
  client's Host always travels in ``X-Forwarded-Host`` and ``Forwarded: host=``.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from geolimit.http.keys import Network

__all__ = ["DROPPED", "HOP_BY_HOP", "forwarded_element", "rebuilt_headers", "request_headers", "response_headers"]

_Headers = CIMultiDict[str] | CIMultiDictProxy[str]

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade",
})
#: Request headers the proxy sets itself (or answers, for Expect).
_REBUILT = frozenset({
    "host", "content-length", "expect", "forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host",
})
_DROPPED = HOP_BY_HOP | _REBUILT
#: Request headers never passed on as they came (the names in lower case; also ``proxy-*``).
DROPPED = _DROPPED
_TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _named_in_connection(headers: _Headers) -> frozenset[str]:
    values = headers.getall("Connection", ())
    if not values:
        return frozenset()
    return frozenset(name.strip().lower() for value in values for name in value.split(",") if name.strip())


def _hop(name: str, named: frozenset[str]) -> bool:
    lower = name.lower()
    return lower in HOP_BY_HOP or lower.startswith("proxy-") or lower in named


def _quoted(value: str) -> str:
    """A token, or an RFC 7230 quoted-string (``"`` and ``\\`` escaped)."""
    if _TOKEN_RE.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _node(peer: str | None) -> str:
    """An RFC 7239 node: IPv4 as is, IPv6 as ``"[v6]"``, otherwise ``unknown``."""
    if not peer:
        return "unknown"
    try:
        addr = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return "unknown"
    if addr.version == 6:
        return f'"[{addr.compressed}]"'
    return str(addr)


@functools.lru_cache(maxsize=4096)
def forwarded_element(peer: str | None, proto: str, host: str | None) -> str:
    """This hop's ``Forwarded`` element: ``for=...;proto=...;host=...``."""
    element = f"for={_node(peer)};proto={_quoted(proto)}"
    if host:
        element += f";host={_quoted(host)}"
    return element


@functools.lru_cache(maxsize=4096)
def _peer_trusted(peer: str | None, trusted: tuple[Network, ...]) -> bool:
    if not peer or not trusted:
        return False
    try:
        addr = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    return any(addr in net for net in trusted)


def request_headers(
    headers: _Headers,
    *,
    peer: str | None,
    scheme: str,
    trusted: tuple[Network, ...],
    upstream_host: str | None,
    content_length: int | None,
) -> CIMultiDict[str]:
    """The headers to send upstream for a request with ``headers`` from ``peer``.

    ``upstream_host`` is the Host to send (None: keep the client's). ``content_length``
    is set when the body's length is known (None: no body, or a chunked one).
    """
    named = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _DROPPED or lower.startswith("proxy-") or (named and lower in named):
            continue
        out.add(name, value)
    client_host = headers.get("Host")
    out["Host"] = client_host if upstream_host is None and client_host else (upstream_host or "")
    if not out["Host"]:
        del out["Host"]
    if content_length is not None:
        out["Content-Length"] = str(content_length)
    for name, value in rebuilt_headers(client_host, lambda n: headers.getall(n, []), peer=peer, scheme=scheme,
                                       trusted=trusted):
        out[name] = value
    return out


def rebuilt_headers(client_host: str | None, values: Callable[[str], list[str]], *, peer: str | None, scheme: str,
                    trusted: tuple[Network, ...]) -> list[tuple[str, str]]:
    """``X-Forwarded-For``, ``-Proto``, ``-Host`` and ``Forwarded`` for this hop (the module docstring).

    ``values(name)`` gives every value of a request header (``name`` in lower case).
    """
    trusted_peer = _peer_trusted(peer, trusted)
    node = peer or "unknown"
    xff = _joined_values(values("x-forwarded-for")) if trusted_peer else ""
    out = [("X-Forwarded-For", f"{xff}, {node}" if xff else node)]
    proto = (_first(values("x-forwarded-proto")) if trusted_peer else "") or scheme
    out.append(("X-Forwarded-Proto", proto))
    host = (_first(values("x-forwarded-host")) if trusted_peer else "") or client_host
    if host:
        out.append(("X-Forwarded-Host", host))
    forwarded = _joined_values(values("forwarded")) if trusted_peer else ""
    element = forwarded_element(peer, scheme, client_host)
    out.append(("Forwarded", f"{forwarded}, {element}" if forwarded else element))
    return out


def _first(values: list[str]) -> str:
    return values[0].strip() if values else ""


def _joined_values(values: list[str]) -> str:
    return ", ".join(v.strip() for v in values if v.strip())


def response_headers(headers: _Headers, extra: Iterable[tuple[str, str]] = ()) -> CIMultiDict[str]:
    """The upstream response's end-to-end headers, plus ``extra`` (replacing same-named ones)."""
    named = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if not _hop(name, named):
            out.add(name, value)
    for name, value in extra:
        out[name] = value
    return out

"""What a request needs of the running configuration: :class:`State` (replaced whole on reload)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from yarl import URL

from geolimit.http.guard import Guard
from geolimit.http.keys import Network
from geolimit.proxy.config import ProxyConfig

__all__ = ["State", "Upstream", "upstream_for"]


@dataclass(frozen=True)
class Upstream:
    base: str  # scheme://host:port
    host: str  # the Host header for it


@dataclass(frozen=True)
class State:
    """Everything a reload replaces at once; a request keeps the state it started with."""

    config: ProxyConfig
    guard: Guard
    trusted: tuple[Network, ...]
    upstreams: tuple[Upstream, ...]
    timeout: aiohttp.ClientTimeout
    checked_costs: frozenset[int]  # id() of policies whose costs come from the request


def upstream_for(url: str) -> Upstream:
    """An upstream base URL and the Host header that names it."""
    parsed = URL(url)
    host = parsed.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    if not parsed.is_default_port():
        host += f":{parsed.port}"
    return Upstream(url, host)

"""The exception tree. Every error geolimit raises is a :class:`GeolimitError`.

redis-py and aiohttp errors are translated at the I/O boundary, so callers only
ever need to catch the classes defined here. The original exception is kept as
``__cause__``::

    GeolimitError
    ├── ConfigError (ValueError)
    │   └── UnknownRuleError (LookupError)
    ├── RequestError (ValueError)
    │   └── BadRequest              the agent's HTTP API refuses a request
    ├── StorageError
    ├── ProtocolError
    │   └── AuthenticationError
    │       └── ClockSkewError      a signed message from a peer whose clock is too far off
    ├── TransportError
    │   └── PeerRefused
    ├── RateLimited                 raised by limited() / limit() / alimit()
    └── NetsimError (RuntimeError)

Some classes are also importable from the module that raises them
(``geolimit.RateLimited``, ``geolimit.decorators.RateLimited``,
``geolimit.replication.transport.TransportError``, ``geolimit.netsim.NetsimError``,
``geolimit.server.api.BadRequest``): those names are these classes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from geolimit.core.decision import Decision

__all__ = [
    "AuthenticationError",
    "BadRequest",
    "ClockSkewError",
    "ConfigError",
    "GeolimitError",
    "NetsimError",
    "PeerRefused",
    "PortInUseError",
    "ProtocolError",
    "RateLimited",
    "RequestError",
    "StorageError",
    "TransportError",
    "UnknownRuleError",
]


class GeolimitError(Exception):
    """Root of every error raised by geolimit."""


class ConfigError(GeolimitError, ValueError):
    """A rule, rate string, URL or configuration file is invalid."""


class UnknownRuleError(ConfigError, LookupError):
    """A request named a rule that the limiter does not know."""

    def __init__(self, rule: str, known: list[str] | tuple[str, ...] = ()) -> None:
        self.rule = rule
        hint = f"; known rules: {', '.join(sorted(known))}" if known else ""
        group = sorted(k for k in known if k.startswith(rule + "."))
        if group:  # Rule.parse_many("api", "10/hour;5/minute") makes api.1h and api.1m
            hint += f" ({', '.join(group)} are {rule!r}'s rates: pass {group!r} to decide them all-or-nothing)"
        super().__init__(f"unknown rule {rule!r}{hint}")


class RequestError(GeolimitError, ValueError):
    """A call's arguments are invalid (bad cost, subject too long, ...)."""


class BadRequest(RequestError):
    """A request the agent's HTTP API refuses: ``status`` (400, 401, 404 or 413) and
    ``field``, the offending field of the body or query (or ``None``)."""

    def __init__(self, message: str, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


class StorageError(GeolimitError):
    """Redis could not be reached or answered with an error."""


class PortInUseError(StorageError):
    """An embedded redis-server's fixed ``port`` on ``host`` is held by another process."""

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host, self.port = host, port


class ProtocolError(GeolimitError):
    """A replication (gossip) message could not be decoded or is malformed."""


class AuthenticationError(ProtocolError):
    """A replication message is unsigned, forged, replayed or too old."""


class ClockSkewError(AuthenticationError):
    """A correctly signed replication message whose time is outside the auth window:
    the peer's clock (or a replayed old message) is ``offset`` seconds off ours."""

    def __init__(self, message: str, peer: str, offset: float) -> None:
        super().__init__(message)
        self.peer = peer
        self.offset = offset


class TransportError(GeolimitError):
    """A peer could not be reached or refused a message. ``status`` is the peer's HTTP
    answer when it gave one (None: unreachable, timed out, or not HTTP), ``reason`` the
    ``reason`` of its JSON error body (``"auth"``: it does not accept our signature)."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class PeerRefused(TransportError):
    """The peer received the message and refused its content (HTTP 400): sending
    the same message again would be refused again."""

    def __init__(self, message: str, status: int, reason: str | None = None) -> None:
        super().__init__(message, status, reason)


class RateLimited(GeolimitError):
    """A call was denied by a rate limit; ``decision`` says which rule and for how long."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        if math.isfinite(decision.retry_after):
            wait = f"retry in {decision.retry_after:.3f} s"
        else:
            wait = "the cost exceeds the limit"
        super().__init__(f"rate limit {decision.rule!r} exceeded ({decision.limit} per window): {wait}")

    @property
    def retry_after(self) -> float:
        """Seconds to wait before the same call can succeed (``inf``: never)."""
        return self.decision.retry_after


class NetsimError(GeolimitError, RuntimeError):
    """A netsim background task crashed (``__cause__`` is the original exception), or a
    :class:`~geolimit.netsim.FaultyLink` was started twice or used before ``start()``."""

"""The exception tree. Every error geolimit raises is a :class:`GeolimitError`.

redis-py and aiohttp errors are translated at the I/O boundary, so callers only
ever need to catch the classes defined here. The original exception is kept as
``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "GeolimitError",
    "ProtocolError",
    "RequestError",
    "StorageError",
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
        super().__init__(f"unknown rule {rule!r}{hint}")


class RequestError(GeolimitError, ValueError):
    """A call's arguments are invalid (bad cost, subject too long, ...)."""


class StorageError(GeolimitError):
    """Redis could not be reached or answered with an error."""


class ProtocolError(GeolimitError):
    """A replication (gossip) message could not be decoded or is malformed."""


class AuthenticationError(ProtocolError):
    """A replication message is unsigned, forged, replayed or too old."""

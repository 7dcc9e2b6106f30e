"""The public API is a curated, pinned surface."""

from __future__ import annotations

import geolimit
from geolimit import errors

PUBLIC = {
    "AsyncLimiter",
    "AuthenticationError",
    "ConfigError",
    "Decision",
    "GeolimitError",
    "KeyLayout",
    "Limiter",
    "ManualClock",
    "ProtocolError",
    "RateLimited",
    "RequestError",
    "Rule",
    "RuleDecision",
    "StorageError",
    "UnknownRuleError",
    "Usage",
    "alimit",
    "limit",
    "limited",
    "parse_rate",
}


def test_all_is_pinned() -> None:
    assert set(geolimit.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(geolimit, name) is not None


def test_issue_names_are_importable() -> None:
    from geolimit import (  # noqa: F401
        AsyncLimiter,
        ConfigError,
        Decision,
        GeolimitError,
        Limiter,
        Rule,
        StorageError,
    )


def test_every_error_is_a_geolimit_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), geolimit.GeolimitError)
    assert issubclass(geolimit.ConfigError, ValueError)

"""Rules: what is limited, how much, over which window, at which bucket resolution.

A :class:`Rule` is a plain, immutable value. Everything the Lua scripts and the
replication agent need to agree on is derived from it here, in one place:

* ``resolution_us`` / ``window_us`` -- integer microseconds, so bucket maths is exact;
* ``buckets`` (N) -- buckets per window; a strict decision counts N + 1 buckets;
* ``future`` (F) -- how many buckets ahead of the local clock a remote region's
  entries may be (clock-skew tolerance);
* ``ring`` (M) -- ring size of a key's bucket positions, ``N + F + 1``;
* ``ttl_ms`` -- key expiry: the window plus the skew tolerance plus a grace bucket.

Two processes that write the same Redis keys must use rules with the same name,
window and resolution; the limit and the policies may differ (and may be
reloaded at any time).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from geolimit.core.window import MAX_COUNT
from geolimit.errors import ConfigError

__all__ = ["MAX_BUCKETS", "MAX_CLOCK_SKEW", "Mode", "Partition", "Rule", "parse_duration", "parse_rate"]

Mode = Literal["strict", "approximate"]
Partition = Literal["local", "share", "closed"]

#: Clock skew between regions that replicated entries may carry, in seconds.
#: Entries further in the future than this are dropped (anti-entropy re-sends
#: them once the local clock has caught up).
MAX_CLOCK_SKEW = 2.0
#: Upper bound on buckets per window: every decision reads all of a key's buckets.
MAX_BUCKETS = 3600
_MIN_RESOLUTION_US = 1_000

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

_UNITS: dict[str, float] = {}
for _names, _seconds in (
    (("ms", "msec", "millisecond", "milliseconds"), 0.001),
    (("s", "sec", "secs", "second", "seconds"), 1.0),
    (("m", "min", "mins", "minute", "minutes"), 60.0),
    (("h", "hr", "hrs", "hour", "hours"), 3600.0),
    (("d", "day", "days"), 86400.0),
    (("w", "wk", "week", "weeks"), 604800.0),
):
    for _name in _names:
        _UNITS[_name] = _seconds

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DURATION_RE = re.compile(rf"^\s*({_NUMBER})?\s*([A-Za-z]+)\s*$")
_RATE_RE = re.compile(r"^\s*(\d+)\s*(?:/|\s+per\s+)\s*(.+?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Parse ``"10s"``, ``"2m"``, ``"minute"``, ``"1.5 hours"`` or ``"250ms"`` into seconds."""
    match = _DURATION_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"invalid duration {text!r}: expected a number and a unit such as '10s', "
            f"'2m', 'hour' or '250ms'"
        )
    amount = float(match.group(1)) if match.group(1) else 1.0
    seconds = amount * _UNITS[match.group(2).lower()]
    if not seconds > 0:
        raise ConfigError(f"invalid duration {text!r}: must be greater than zero")
    return seconds


def parse_rate(text: str) -> tuple[int, float]:
    """Parse a rate string into ``(limit, window_seconds)``.

    Accepted forms: ``"100/minute"``, ``"1000/10s"``, ``"5 per hour"``, ``"10/2m"``.
    """
    if not isinstance(text, str):
        raise ConfigError(f"invalid rate {text!r}: expected a string such as '100/minute'")
    match = _RATE_RE.match(text)
    if match is None:
        raise ConfigError(
            f"invalid rate {text!r}: expected '<count>/<window>' such as '100/minute', "
            f"'1000/10s', '10/2m' or '5 per hour'"
        )
    try:
        window = parse_duration(match.group(2))
    except ConfigError:
        raise ConfigError(
            f"invalid rate {text!r}: the window {match.group(2)!r} is not a duration "
            f"such as 'minute', '10s', '2m' or 'hour'"
        ) from None
    return int(match.group(1)), window


def _to_us(seconds: float, what: str, rule: str) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(f"rule {rule!r}: {what} must be a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"rule {rule!r}: {what} must be a positive number of seconds, got {seconds!r}")
    micros = round(seconds * 1_000_000)
    if abs(micros - seconds * 1_000_000) > 1e-3 * max(1.0, seconds * 1_000):
        raise ConfigError(f"rule {rule!r}: {what} {seconds!r}s is not a whole number of microseconds")
    return micros


@dataclass(frozen=True)
class Rule:
    """A rate limit: at most ``limit`` units of cost per ``window`` seconds.

    ``resolution`` is the bucket width (default ``window / 10``); ``window`` must be
    a whole multiple of it. ``mode="strict"`` (the default) never admits more than
    ``limit`` in any true window within one region; ``"approximate"`` weights the
    oldest bucket by its overlap with the window, admitting slightly more.

    Across regions (see :mod:`geolimit.core.policy`): ``predict`` reserves budget
    for what peers probably admitted since their counts were last current;
    ``partition`` decides what happens once a peer's counts are older than
    ``partition_after`` seconds: ``"local"`` keeps deciding on the last known
    counts, ``"share"`` caps every side of the partition at its fair share,
    ``"closed"`` denies. None of these change the rule's keys.
    """

    name: str
    limit: int
    window: float
    resolution: float | None = None
    mode: Mode = "strict"
    predict: bool = True
    partition: Partition = "local"
    partition_after: float = 1.0

    resolution_us: int = field(init=False, repr=False, compare=False)
    window_us: int = field(init=False, repr=False, compare=False)
    buckets: int = field(init=False, repr=False, compare=False)
    future: int = field(init=False, repr=False, compare=False)
    ring: int = field(init=False, repr=False, compare=False)
    ttl_ms: int = field(init=False, repr=False, compare=False)
    partition_after_us: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(
                f"invalid rule name {self.name!r}: use 1-64 characters from A-Z a-z 0-9 _ . -"
            )
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 0 <= self.limit <= MAX_COUNT:
            raise ConfigError(
                f"rule {self.name!r}: limit must be an integer from 0 to 2**46 ({MAX_COUNT}), got {self.limit!r}"
            )
        if self.mode not in ("strict", "approximate"):
            raise ConfigError(
                f"rule {self.name!r}: mode must be 'strict' or 'approximate', got {self.mode!r}"
            )
        if self.partition not in ("local", "share", "closed"):
            raise ConfigError(
                f"rule {self.name!r}: partition must be 'local', 'share' or 'closed', got {self.partition!r}"
            )
        if not isinstance(self.predict, bool):
            raise ConfigError(f"rule {self.name!r}: predict must be true or false, got {self.predict!r}")
        object.__setattr__(self, "partition_after_us", _to_us(self.partition_after, "partition_after", self.name))
        window_us = _to_us(self.window, "window", self.name)
        resolution = self.window / 10 if self.resolution is None else self.resolution
        resolution_us = _to_us(resolution, "resolution", self.name)
        if self.resolution is None and window_us % 10:
            raise ConfigError(
                f"rule {self.name!r}: window {self.window!r}s cannot be split into 10 buckets "
                f"of whole microseconds; pass resolution explicitly"
            )
        if resolution_us < _MIN_RESOLUTION_US:
            raise ConfigError(
                f"rule {self.name!r}: resolution {resolution!r}s is below the minimum of 1 ms"
            )
        if window_us % resolution_us:
            raise ConfigError(
                f"rule {self.name!r}: window {self.window!r}s is not a whole multiple of "
                f"resolution {resolution!r}s"
            )
        buckets = window_us // resolution_us
        if buckets > MAX_BUCKETS:
            raise ConfigError(
                f"rule {self.name!r}: {buckets} buckets per window is more than {MAX_BUCKETS}; "
                f"use a coarser resolution"
            )
        future = max(1, math.ceil(MAX_CLOCK_SKEW * 1_000_000 / resolution_us))
        object.__setattr__(self, "resolution", resolution_us / 1_000_000)
        object.__setattr__(self, "resolution_us", resolution_us)
        object.__setattr__(self, "window_us", window_us)
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "future", future)
        object.__setattr__(self, "ring", buckets + future + 1)
        ttl_us = window_us + (future + 2) * resolution_us
        object.__setattr__(self, "ttl_ms", -(-ttl_us // 1000))

    @classmethod
    def from_string(
        cls,
        name: str,
        rate: str,
        resolution: float | str | None = None,
        mode: Mode = "strict",
        **options: Any,
    ) -> Rule:
        """Build a rule from a rate string: ``Rule.from_string("api", "100/minute")``.

        ``resolution`` may be seconds or a duration string such as ``"1s"``.
        """
        limit, window = parse_rate(rate)
        if isinstance(resolution, str):
            resolution = parse_duration(resolution)
        return cls(name, limit, window, resolution, mode, **options)

    def with_limit(self, limit: int) -> Rule:
        """The same rule (same keys) with another limit."""
        return replace(self, limit=limit)

    @property
    def structure(self) -> tuple[int, int]:
        """What must match between every writer of this rule's keys."""
        return (self.window_us, self.resolution_us)

    def describe(self) -> str:
        """A short human description, such as ``"100/60s (6s buckets, strict)"``."""
        return f"{self.limit}/{_fmt_seconds(self.window)} ({_fmt_seconds(self.resolution_us / 1e6)} buckets, {self.mode})"


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{seconds:g}s"

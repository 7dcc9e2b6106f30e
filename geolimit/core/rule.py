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

import contextlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from geolimit.core.window import MAX_COUNT
from geolimit.errors import ConfigError

__all__ = [
    "MAX_BUCKETS", "MAX_CLOCK_SKEW", "MAX_WINDOW", "Mode", "Partition", "Rule", "parse_duration", "parse_rate",
    "parse_rates", "window_label",
]

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

#: The longest window a rule may have: 100 years of 365 days. Bucket times are
#: microseconds since 1970 in Lua doubles (exact below 2**53, until the year
#: 2255); the clock plus a window must stay there.
MAX_WINDOW = 100 * 365 * 86400

#: Rate-string unit lengths; ``month`` and ``year`` are those of the ``limits``
#: library (30 and 360 days).
_UNITS: dict[str, float] = {}
for _names, _seconds in (
    (("ms", "msec", "millisecond", "milliseconds"), 0.001),
    (("s", "sec", "secs", "second", "seconds"), 1.0),
    (("m", "min", "mins", "minute", "minutes"), 60.0),
    (("h", "hr", "hrs", "hour", "hours"), 3600.0),
    (("d", "day", "days"), 86400.0),
    (("w", "wk", "week", "weeks"), 604800.0),
    (("mo", "month", "months"), 2592000.0),
    (("y", "yr", "yrs", "year", "years"), 31104000.0),
):
    for _name in _names:
        _UNITS[_name] = _seconds

# Digits and letters are ASCII only (no re.IGNORECASE: it would match the Kelvin sign as "k").
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION_RE = re.compile(rf"\s*({_NUMBER})?\s*([A-Za-z]+)\s*")
_RATE_RE = re.compile(r"\s*([0-9]+)\s*(?:/|[Pp][Ee][Rr])\s*(.*?)\s*", re.DOTALL)
_SEPARATORS = re.compile(r"[,;|]")
#: Digits accepted in a rate's count (MAX_COUNT has 14).
_MAX_DIGITS = 20
_RATE_FORMS = "'100/minute', '1000/10s', '10/2m', '5 per hour' or '10/hour;5/minute'"


class _NotPositive(ConfigError):
    """A duration of zero."""


class _TooLong(ConfigError):
    """A duration past what a float holds."""


def parse_duration(text: str) -> float:
    """Parse ``"10s"``, ``"2m"``, ``"minute"``, ``"1.5 hours"`` or ``"250ms"`` into seconds.

    ASCII digits and unit names only (any case); ``month`` is 30 days and
    ``year`` 360 days, as in the ``limits`` library.
    """
    match = _DURATION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"invalid duration {text!r}: expected a number and a unit such as '10s', "
            f"'2m', 'hour' or '250ms'"
        )
    amount = float(match.group(1)) if match.group(1) else 1.0
    seconds = amount * _UNITS[match.group(2).lower()]
    if not seconds > 0:
        raise _NotPositive(f"invalid duration {text!r}: must be greater than zero")
    if not math.isfinite(seconds):
        raise _TooLong(f"invalid duration {text!r}: too long")
    return seconds


def _window_too_long(seconds: float) -> str | None:
    if seconds <= MAX_WINDOW:
        return None
    return f"({seconds:.6g} s) is longer than the largest window, {MAX_WINDOW} s (100 years of 365 days)"


def _parse_one(text: str, part: str, where: str) -> tuple[int, float]:
    match = _RATE_RE.fullmatch(part)
    if match is None:
        raise ConfigError(f"invalid rate {text!r}{where}: expected '<count>/<window>' such as {_RATE_FORMS}")
    digits, window_text = match.group(1).lstrip("0") or "0", match.group(2)
    if len(digits) > _MAX_DIGITS or int(digits) > MAX_COUNT:
        raise ConfigError(
            f"invalid rate {text!r}{where}: the count must be at most {MAX_COUNT} (2**46), "
            f"got {digits if len(digits) <= _MAX_DIGITS else digits[:_MAX_DIGITS] + '...'}"
        )
    try:
        window = parse_duration(window_text)
    except _NotPositive:
        raise ConfigError(
            f"invalid rate {text!r}{where}: the window {window_text!r} must be greater than zero"
        ) from None
    except _TooLong:
        window = math.inf
    except ConfigError:
        raise ConfigError(
            f"invalid rate {text!r}{where}: the window {window_text!r} is not a duration "
            f"such as 'minute', '10s', '2m', 'hour', 'month' or '250ms'"
        ) from None
    too_long = _window_too_long(window)
    if too_long:
        raise ConfigError(f"invalid rate {text!r}{where}: the window {window_text!r} {too_long}")
    return int(digits), window


def parse_rates(text: str) -> list[tuple[int, float]]:
    """Parse one or more rates into ``[(limit, window_seconds), ...]``, in order.

    Each rate is ``<count>/<window>`` or ``<count> per <window>`` (spaces
    optional): ``"100/minute"``, ``"1000/10s"``, ``"5 per hour"``, ``"10per2minutes"``,
    ``"7/250ms"``. Several rates are separated by ``;``, ``,`` or ``|``:
    ``"10/hour;5/minute"``. The syntax of the ``limits`` library is a subset.
    """
    if not isinstance(text, str):
        raise ConfigError(f"invalid rate {text!r}: expected a string such as {_RATE_FORMS}")
    parts = _SEPARATORS.split(text)
    if len(parts) == 1:
        return [_parse_one(text, text, "")]
    out = []
    for i, part in enumerate(parts, 1):
        where = f" (limit {i} of {len(parts)}: {part.strip()!r})"
        if not part.strip():
            raise ConfigError(f"invalid rate {text!r}: limit {i} of {len(parts)} is empty")
        out.append(_parse_one(text, part, where))
    return out


def parse_rate(text: str) -> tuple[int, float]:
    """Parse one rate string into ``(limit, window_seconds)`` (see :func:`parse_rates`).

    Accepted forms: ``"100/minute"``, ``"1000/10s"``, ``"5 per hour"``, ``"10/2m"``.
    A string holding several limits is refused: use :func:`parse_rates`.
    """
    rates = parse_rates(text)
    if len(rates) > 1:
        raise ConfigError(
            f"invalid rate {text!r}: it holds {len(rates)} limits where one is expected "
            f"(parse_rates and Rule.parse_many read several)"
        )
    return rates[0]


def window_label(seconds: float) -> str:
    """A short name for a window, in its largest whole unit: ``"1h"``, ``"90s"``, ``"250ms"``."""
    micros = round(seconds * 1_000_000)
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000),
                       ("ms", 1_000)):
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros}us"


def _number(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else repr(seconds)


def _to_us(seconds: float, what: str, rule: str) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        hint = ""
        if isinstance(seconds, str):
            with contextlib.suppress(ConfigError):
                hint = f" (write {_number(parse_duration(seconds))}, or use Rule.from_string for rate strings)"
        raise ConfigError(f"rule {rule!r}: {what} must be a number of seconds, got {seconds!r}{hint}")
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

    ``escrow=True`` makes the limit a hard bound across regions (see
    :mod:`geolimit.core.escrow`): each region admits only within the rights it
    holds, and rights move between regions every gossip round. ``mode``,
    ``predict``, ``partition`` and ``partition_after`` do not apply to it.
    """

    name: str
    limit: int
    window: float
    resolution: float | None = None
    mode: Mode = "strict"
    predict: bool = True
    partition: Partition = "local"
    partition_after: float = 1.0
    escrow: bool = False

    resolution_us: int = field(init=False, repr=False, compare=False)
    window_us: int = field(init=False, repr=False, compare=False)
    buckets: int = field(init=False, repr=False, compare=False)
    future: int = field(init=False, repr=False, compare=False)
    ring: int = field(init=False, repr=False, compare=False)
    ttl_ms: int = field(init=False, repr=False, compare=False)
    partition_after_us: int = field(init=False, repr=False, compare=False)
    escrow_steps: int = field(init=False, repr=False, compare=False)

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
        self._check_escrow()
        window_us = _to_us(self.window, "window", self.name)
        too_long = _window_too_long(self.window)
        if too_long:
            raise ConfigError(f"rule {self.name!r}: the window {too_long}")
        resolution = self.window / 10 if self.resolution is None else self.resolution
        resolution_us = _to_us(resolution, "resolution", self.name)
        if self.resolution is None and window_us % 10:
            raise ConfigError(
                f"rule {self.name!r}: window {self.window!r}s cannot be split into 10 buckets "
                f"of whole microseconds; pass resolution explicitly"
            )
        if resolution_us < _MIN_RESOLUTION_US and self.resolution is None:
            raise ConfigError(
                f"rule {self.name!r}: window {self.window!r}s is too short for the default 10 buckets (window / 10 "
                f"= {resolution!r}s, below the minimum resolution of 1 ms): use a window of 10 ms or more, or pass "
                f"a resolution of 1 ms or more that divides the window (resolution='1ms' or 0.001)")
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
        # Escrow mode counts a region's own admissions in steps of resolution / k:
        # the largest of 4, 2, 1 that splits a bucket into whole microseconds.
        object.__setattr__(self, "escrow_steps", next(k for k in (4, 2, 1) if resolution_us % k == 0))

    def _check_escrow(self) -> None:
        if not isinstance(self.escrow, bool):
            raise ConfigError(f"rule {self.name!r}: escrow must be true or false, got {self.escrow!r}")
        if not self.escrow:
            return
        combined = [
            name for name, given, default in (
                ("mode", self.mode, "strict"), ("predict", self.predict, True),
                ("partition", self.partition, "local"), ("partition_after", self.partition_after, 1.0),
            ) if given != default
        ]
        if combined:
            raise ConfigError(
                f"rule {self.name!r}: {', '.join(combined)} do{'es' if len(combined) == 1 else ''} not apply to an "
                f"escrow rule (escrow = true admits only within this region's rights, whatever the timing): "
                f"remove {' and '.join(combined)} or escrow"
            )

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

    @classmethod
    def parse_many(
        cls,
        name: str,
        rates: str,
        resolution: float | str | None = None,
        mode: Mode = "strict",
        **options: Any,
    ) -> list[Rule]:
        """One rule per limit of ``rates``: ``Rule.parse_many("api", "10/hour;5/minute")``.

        A single limit keeps ``name``; several are named ``<name>.<window>``
        (``api.1h``, ``api.1m``), so their windows must differ. Pass the list to
        ``hit`` (all-or-nothing) or to the limiter's ``rules``. ``resolution`` and
        the options apply to every rule.
        """
        parsed = parse_rates(rates)
        if isinstance(resolution, str):
            resolution = parse_duration(resolution)
        if len(parsed) == 1:
            limit, window = parsed[0]
            return [cls(name, limit, window, resolution, mode, **options)]
        labels = [window_label(window) for _, window in parsed]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ConfigError(
                    f"invalid rate {rates!r} for rule {name!r}: two limits over the same window ({label}); "
                    f"keep the stricter one"
                )
        return [
            cls(f"{name}.{label}", limit, window, resolution, mode, **options)
            for (limit, window), label in zip(parsed, labels, strict=True)
        ]

    def with_limit(self, limit: int) -> Rule:
        """The same rule (same keys) with another limit."""
        return replace(self, limit=limit)

    @property
    def structure(self) -> tuple[int, int, int]:
        """What must match between every writer of this rule's keys: window, resolution
        and whether the rule is in escrow mode (1) or gossip mode (0)."""
        return (self.window_us, self.resolution_us, 1 if self.escrow else 0)

    def describe(self) -> str:
        """A short human description, such as ``"100/60s (6s buckets, strict)"``."""
        kind = "escrow" if self.escrow else self.mode
        return f"{self.limit}/{_fmt_seconds(self.window)} ({_fmt_seconds(self.resolution_us / 1e6)} buckets, {kind})"


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{seconds:g}s"

"""Clocks. By default decisions use Redis ``TIME`` so every app of a region
shares one clock; tests and simulations inject a :class:`ManualClock`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from geolimit.errors import RequestError

__all__ = ["Clock", "ManualClock", "micros_source"]

Clock = Callable[[], float]


@runtime_checkable
class _MicrosClock(Protocol):
    def now_us(self) -> int: ...


class ManualClock:
    """A clock that only moves when told to; exact to the microsecond."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now_us = round(start * 1_000_000)

    def now_us(self) -> int:
        return self._now_us

    def __call__(self) -> float:
        return self._now_us / 1_000_000

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise RequestError("a ManualClock never goes backwards; use set() to jump")
        self._now_us += round(seconds * 1_000_000)

    def advance_us(self, micros: int) -> None:
        if micros < 0:
            raise RequestError("a ManualClock never goes backwards; use set() to jump")
        self._now_us += micros

    def set(self, seconds: float) -> None:
        self._now_us = round(seconds * 1_000_000)

    def set_us(self, micros: int) -> None:
        self._now_us = micros


def micros_source(clock: Clock | None) -> Callable[[], int] | None:
    """A function returning integer microseconds, or None to use Redis TIME."""
    if clock is None:
        return None
    if isinstance(clock, _MicrosClock):
        return clock.now_us
    return lambda: round(clock() * 1_000_000)

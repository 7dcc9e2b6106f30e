"""A decider that passes decisions on and turns configuration failures into storage failures.

Shared by the proxy (geolimit/proxy/decider.py) and the middlewares
(geolimit/middleware/common.py): subjects longer than the limiter accepts are hashed
(:func:`~geolimit.http.keys.bounded_subject`), and a decision that fails for a
configuration problem (a rule the agent does not know, one removed from the limiter
since, a window that disagrees with Redis) becomes a
:class:`~geolimit.errors.StorageError`, logged at ERROR at most every 10 s, so the
limit fails by its ``on_error`` instead of answering 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from geolimit.core.decision import Decision
from geolimit.errors import GeolimitError, RequestError, StorageError
from geolimit.http.guard import Decider
from geolimit.http.keys import bounded_subject
from geolimit.log_every import LogEvery

__all__ = ["GuardedDecider"]


class GuardedDecider:
    """Wraps ``inner``; ``log`` takes the lines (each begins with ``prefix``); a cost above
    ``max_cost`` (None: no bound here) is a :class:`~geolimit.errors.RequestError`."""

    def __init__(self, inner: Decider, log: logging.Logger, prefix: str = "", max_cost: int | None = None) -> None:
        self.inner = inner
        self.lines = LogEvery(log, level=logging.ERROR)  # one line per 10 s, counting the others
        self.prefix = prefix
        self.max_cost = max_cost

    async def hit(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """Decide ``rules`` (several: all-or-nothing) and consume."""
        self._check_cost(cost)
        try:  # written out (not through a shared coroutine): one coroutine less on the busiest path
            return await self.inner.hit(rules, bounded_subject(subject), cost)
        except (StorageError, RequestError):
            raise
        except GeolimitError as exc:
            raise self._misconfigured(rules, exc) from exc

    async def peek(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """The decision ``hit`` would make, consuming nothing."""
        self._check_cost(cost)
        try:
            return await self.inner.peek(rules, bounded_subject(subject), cost)
        except (StorageError, RequestError):
            raise
        except GeolimitError as exc:
            raise self._misconfigured(rules, exc) from exc

    def _check_cost(self, cost: int) -> None:
        if self.max_cost is not None and cost > self.max_cost:
            raise RequestError(f"cost {cost} is above the maximum of {self.max_cost}")

    def _misconfigured(self, rules: str | Sequence[str], exc: GeolimitError) -> StorageError:
        names = rules if isinstance(rules, str) else ", ".join(rules)
        self.lines.warn("misconfigured", f"{self.prefix}cannot decide rule(s) {names} (configuration problem)",
                        str(exc), "request(s) could not be decided")
        return StorageError(f"cannot decide rule(s) {names}: {exc}")

"""The proxy's decider: the region's Redis (library mode) or its agent, behind one guard.

Every failure to decide becomes a :class:`~geolimit.errors.StorageError`, so each
limit's ``on_error`` applies (an agent that does not know a rule, a rule whose
window disagrees with Redis): the proxy never answers 500 for them. Subjects
longer than the limiter accepts (a huge API key header) are hashed, and header
values that are not UTF-8 are used as their raw bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.decision import Decision
from geolimit.errors import GeolimitError, RequestError, StorageError
from geolimit.http.agent_client import AgentClient
from geolimit.http.keys import bounded_subject
from geolimit.log_every import LogEvery
from geolimit.store.protocol import MAX_COST

__all__ = ["ProxyDecider"]

log = logging.getLogger("geolimit.proxy")


class ProxyDecider:
    """Wraps an :class:`AsyncLimiter` or an :class:`AgentClient` for the guard."""

    def __init__(self, inner: AsyncLimiter | AgentClient) -> None:
        self.inner = inner
        self.lines = LogEvery(log, level=logging.ERROR)  # one line per 10 s, counting the others

    async def hit(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """Decide ``rules`` (several: all-or-nothing) and consume."""
        if cost > MAX_COST:
            raise RequestError(f"cost {cost} is above the maximum of {MAX_COST}")
        try:  # as _decide, one coroutine less on the proxy's busiest path
            return await self.inner.hit(rules, bounded_subject(subject), cost)
        except (StorageError, RequestError):
            raise
        except GeolimitError as exc:
            raise self._misconfigured(rules, exc) from exc

    async def peek(self, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """The decision ``hit`` would make, consuming nothing."""
        return await self._decide(self.inner.peek, rules, subject, cost)

    async def _decide(self, call: Callable[[str | Sequence[str], str | bytes, int], Awaitable[Decision]],
                      rules: str | Sequence[str], subject: str | bytes, cost: int) -> Decision:
        if cost > MAX_COST:
            raise RequestError(f"cost {cost} is above the maximum of {MAX_COST}")
        try:
            return await call(rules, bounded_subject(subject), cost)
        except (StorageError, RequestError):
            raise
        except GeolimitError as exc:
            raise self._misconfigured(rules, exc) from exc

    def _misconfigured(self, rules: str | Sequence[str], exc: GeolimitError) -> StorageError:
        names = rules if isinstance(rules, str) else ", ".join(rules)
        self.lines.warn("misconfigured", f"cannot decide rule(s) {names} (configuration problem)", str(exc),
                        "request(s) could not be decided")
        return StorageError(f"cannot decide rule(s) {names}: {exc}")

    async def close(self) -> None:
        self.lines.close()  # what the log holds back
        if isinstance(self.inner, AsyncLimiter):
            await self.inner.aclose()
        else:
            await self.inner.close()

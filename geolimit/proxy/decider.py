"""The proxy's decider: the region's Redis (library mode) or its agent, behind one guard.

Every failure to decide becomes a :class:`~geolimit.errors.StorageError`, so each
limit's ``on_error`` applies (an agent that does not know a rule, a rule whose
window disagrees with Redis): the proxy never answers 500 for them. Subjects
longer than the limiter accepts (a huge API key header) are hashed, and header
values that are not UTF-8 are used as their raw bytes.
"""

from __future__ import annotations

import logging
import time

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.decision import Decision
from geolimit.errors import GeolimitError, RequestError, StorageError
from geolimit.http.agent_client import AgentClient
from geolimit.http.keys import bounded_subject
from geolimit.store.protocol import MAX_COST

__all__ = ["ProxyDecider"]

log = logging.getLogger("geolimit.proxy")


class ProxyDecider:
    """Wraps an :class:`AsyncLimiter` or an :class:`AgentClient` for the guard."""

    def __init__(self, inner: AsyncLimiter | AgentClient) -> None:
        self.inner = inner
        self._last_log = 0.0

    async def hit(self, rules: str, subject: str | bytes, cost: int = 1) -> Decision:
        if cost > MAX_COST:
            raise RequestError(f"cost {cost} is above the maximum of {MAX_COST}")
        try:
            return await self.inner.hit(rules, bounded_subject(subject), cost)
        except (StorageError, RequestError):
            raise
        except GeolimitError as exc:
            now = time.monotonic()
            if now - self._last_log > 10.0:
                self._last_log = now
                log.error("cannot decide rule %r (configuration problem): %s", rules, exc)
            raise StorageError(f"cannot decide rule {rules!r}: {exc}") from exc

    async def close(self) -> None:
        if isinstance(self.inner, AsyncLimiter):
            await self.inner.aclose()
        else:
            await self.inner.close()

"""The proxy's decider: the region's Redis (library mode) or its agent, behind one guard.

Every failure to decide becomes a :class:`~geolimit.errors.StorageError`, so each
limit's ``on_error`` applies (an agent that does not know a rule, a rule whose
window disagrees with Redis): the proxy never answers 500 for them. Subjects
longer than the limiter accepts (a huge API key header) are hashed, and header
values that are not UTF-8 are used as their raw bytes.
"""

from __future__ import annotations

import logging

from geolimit.async_limiter import AsyncLimiter
from geolimit.http.agent_client import AgentClient
from geolimit.http.guarded_decider import GuardedDecider
from geolimit.store.protocol import MAX_COST

__all__ = ["ProxyDecider"]

log = logging.getLogger("geolimit.proxy")


class ProxyDecider(GuardedDecider):
    """Wraps an :class:`AsyncLimiter` or an :class:`AgentClient` for the guard (costs up to
    :data:`~geolimit.store.protocol.MAX_COST`)."""

    inner: AsyncLimiter | AgentClient

    def __init__(self, inner: AsyncLimiter | AgentClient) -> None:
        super().__init__(inner, log, max_cost=MAX_COST)

    async def close(self) -> None:
        self.lines.close()  # what the log holds back
        if isinstance(self.inner, AsyncLimiter):
            await self.inner.aclose()
        else:
            await self.inner.close()

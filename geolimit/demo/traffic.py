"""The demo's apps: Poisson arrivals in every region, decided by that region's limiter.

Every decision is logged as an oracle :class:`~geolimit.sim.oracle.Request`
(time of arrival, region, cost, allowed), which is what the summary and the plot
measure against the exact global sliding window.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Mapping

from geolimit.aio import cancel_and_wait
from geolimit.async_limiter import AsyncLimiter
from geolimit.errors import GeolimitError
from geolimit.sim.oracle import Request

__all__ = ["SUBJECT", "Traffic", "now_us"]

#: One subject for everyone: the demo limits the service globally.
SUBJECT = "global"


def now_us() -> int:
    return time.time_ns() // 1000


class Traffic:
    """Poisson arrivals at ``rate`` requests per second in each region, until :meth:`stop`."""

    def __init__(
        self, apps: Mapping[str, AsyncLimiter], rule: str, rate: float, window_us: int, *, seed: int = 7
    ) -> None:
        self.apps = dict(apps)
        self.rule = rule
        self.rate = rate
        self.window_us = window_us
        self._rng = random.Random(seed)
        self.log: list[Request] = []
        self.admitted: dict[str, int] = dict.fromkeys(self.apps, 0)
        self.denied: dict[str, int] = dict.fromkeys(self.apps, 0)
        self.errors: dict[str, int] = dict.fromkeys(self.apps, 0)
        self.last_error: str | None = None
        self._recent: collections.deque[int] = collections.deque()  # admitted arrival times
        self._arrivals: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        for name in self.apps:
            rng = random.Random(self._rng.random())
            self._arrivals.append(asyncio.ensure_future(self._arrive(name, rng)))

    async def stop(self, grace: float = 2.0) -> None:
        """No new arrivals; wait up to ``grace`` seconds for decisions in flight, cancel the rest."""
        await cancel_and_wait(self._arrivals)
        self._arrivals.clear()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace)
        await cancel_and_wait(set(self._inflight))

    async def _arrive(self, region: str, rng: random.Random) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += rng.expovariate(self.rate)
            wait = due - loop.time()
            await asyncio.sleep(max(0.0, wait))
            task = asyncio.ensure_future(self._decide(region))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _decide(self, region: str) -> None:
        arrived = now_us()
        try:
            decision = await self.apps[region].hit(self.rule, SUBJECT)
        except GeolimitError as exc:  # Redis is local: only if something is badly wrong
            self.errors[region] += 1
            self.last_error = f"{region}: {exc}"
            return
        self.log.append(Request(arrived, region, 1, decision.allowed))
        if decision.allowed:
            self.admitted[region] += 1
            self._recent.append(arrived)
        else:
            self.denied[region] += 1

    def true_count(self, at_us: int) -> int:
        """Admitted in the trailing window before ``at_us`` (what an exact global limiter counts)."""
        recent = self._recent
        while recent and recent[0] <= at_us - self.window_us:
            recent.popleft()
        return len(recent)

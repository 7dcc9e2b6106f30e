"""A virtual-time scheduler for simulating regions tick by tick.

Virtual time only moves when every task the simulation owns is either finished
or parked on a virtual-time wait, so latency and gossip intervals are exact and a
schedule of events is a deterministic test. Real I/O (Redis) still runs in real
time while virtual time stands still.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable, Iterable

from geolimit.core.clock import ManualClock

__all__ = ["Scheduler", "SkewedClock", "VirtualTime"]


class SkewedClock:
    """A region's view of a shared virtual clock, ``offset`` seconds off."""

    def __init__(self, base: ManualClock, offset: float = 0.0) -> None:
        self.base = base
        self.offset_us = round(offset * 1_000_000)

    def now_us(self) -> int:
        return self.base.now_us() + self.offset_us

    def __call__(self) -> float:
        return self.now_us() / 1_000_000


class Scheduler:
    """Runs timed callbacks in virtual time and parks tasks until a virtual instant."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self._queue: list[tuple[int, int, Callable[[], Awaitable[None]] | asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._parked: set[asyncio.Task[object]] = set()
        self._owners: dict[asyncio.Future[None], asyncio.Task[object] | None] = {}
        self._watched: Callable[[], Iterable[asyncio.Task[object]]] = lambda: ()

    def watch(self, tasks: Callable[[], Iterable[asyncio.Task[object]]]) -> None:
        """Tasks (spawned by engines) that must be parked before time moves."""
        self._watched = tasks

    def at(self, when_us: int, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` (awaited to completion) at virtual time ``when_us``."""
        heapq.heappush(self._queue, (when_us, next(self._seq), callback))

    async def sleep_until(self, when_us: int) -> None:
        """Park the current task until virtual time ``when_us``."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.current_task()
        self._owners[future] = task
        if task is not None:
            self._parked.add(task)
        heapq.heappush(self._queue, (max(when_us, self.clock.now_us()), next(self._seq), future))
        try:
            await future
        finally:
            if task is not None:
                self._parked.discard(task)

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self.clock.now_us() + round(seconds * 1_000_000))

    async def settle(self) -> None:
        """Until every watched task is done or parked."""
        while True:
            busy = [t for t in self._watched() if not t.done() and t not in self._parked]
            if not busy:
                return
            await asyncio.wait(busy, timeout=0.002)

    def next_time(self) -> int | None:
        return self._queue[0][0] if self._queue else None

    async def run_until(self, until_us: int) -> None:
        """Process everything scheduled up to ``until_us``, then leave the clock there."""
        await self.settle()
        while self._queue and self._queue[0][0] <= until_us:
            when, _, item = heapq.heappop(self._queue)
            if when > self.clock.now_us():
                self.clock.set_us(when)
            if isinstance(item, asyncio.Future):
                owner = self._owners.pop(item, None)
                if owner is not None:
                    self._parked.discard(owner)
                if not item.done():
                    item.set_result(None)
            else:
                await item()
            await self.settle()
        if until_us > self.clock.now_us():
            self.clock.set_us(until_us)


class VirtualTime:
    """Driving a simulation's virtual time in seconds (a mixin: ``clock`` and ``scheduler``)."""

    clock: ManualClock
    scheduler: Scheduler

    @property
    def now(self) -> float:
        return self.clock()

    async def advance(self, seconds: float) -> None:
        await self.scheduler.run_until(self.clock.now_us() + round(seconds * 1_000_000))

    async def run_until(self, when: float) -> None:
        await self.scheduler.run_until(round(when * 1_000_000))

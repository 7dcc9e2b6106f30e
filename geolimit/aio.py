"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Coalescer", "cancel_and_wait"]

T = TypeVar("T")
R = TypeVar("R")


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]] | asyncio.Future[Any], attempt: float = 0.1) -> None:
    """Cancel tasks and wait until they have really ended.

    On Python 3.11, ``asyncio.wait_for`` (which redis-py uses to write commands
    when a socket timeout is set) can swallow a cancellation that arrives just as
    the awaited operation completes (CPython gh-86296, fixed in 3.12): the task
    runs on, and a single ``cancel()`` followed by an unbounded wait never
    returns. So cancel again until every task is done.
    """
    pending = {tasks} if isinstance(tasks, asyncio.Future) else set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=attempt)


class Coalescer(Generic[T, R]):
    """Coalesces concurrent requests into batched calls of ``run``.

    Every item submitted while calls are in flight joins a later call; at most
    ``max_in_flight`` calls run at once, each with at most ``max_batch`` items,
    and the queue is shared between the lanes that can run now, so one batch is
    being decided while the next is encoded and decoded. A lane yields to the
    event loop once before it takes a batch, so items whose callbacks are
    already runnable (requests that arrived with the last reply) join it: fewer,
    larger batches under load for one loop iteration of latency. ``run`` returns one
    result per item, in order; if it raises, every item of that batch gets the
    exception (a ``BaseException`` that is not an ``Exception`` is re-raised).
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[Sequence[R]]], max_batch: int, max_in_flight: int) -> None:
        self._run = run
        self._max_batch = max(1, max_batch)
        self._max_in_flight = max(1, max_in_flight)
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._lanes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: T) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((item, future))
        if self._lanes < self._max_in_flight:
            self._lanes += 1
            task = loop.create_task(self._lane())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def wait(self) -> None:
        """Until the calls in flight are done."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _lane(self) -> None:
        try:
            while self._queue:
                await asyncio.sleep(0)  # let the callbacks already runnable add their items first
                size = min(self._max_batch, -(-len(self._queue) // self._max_in_flight))
                batch = self._queue[:size]
                del self._queue[:size]
                try:
                    results = await self._run([item for item, _ in batch])
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._lanes -= 1

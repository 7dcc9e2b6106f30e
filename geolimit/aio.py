"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]


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

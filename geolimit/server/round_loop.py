"""The agent's gossip loop: a round every interval; a failed round is never fatal and never silent.

A round that raises is logged with its traceback, counted (``/v1/status``
``failures.rounds``) and retried after an exponential backoff (at most 30 s).
Only a ``BaseException`` ends the loop: it is then reported as crashed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from geolimit.aio import cancel_and_wait
from geolimit.server.config import AgentConfig

__all__ = ["RoundLoop"]

log = logging.getLogger("geolimit.agent")


class RoundLoop:
    """Runs ``round`` every ``config().interval`` seconds, from the start of one round to the next."""

    def __init__(self, config: Callable[[], AgentConfig], round: Callable[[], Awaitable[None]]) -> None:
        self._config = config
        self._round = round
        self.task: asyncio.Task[None] | None = None
        self.failures = 0  # rounds failed so far (each was retried)
        self.last_failure: str | None = None  # the last failed round (reported, retried)
        self.crashed: str | None = None  # only a BaseException escapes the loop

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())
        self.task.add_done_callback(self._done)

    async def cancel(self) -> None:
        task, self.task = self.task, None
        if task is not None and not task.done():
            await cancel_and_wait(task)

    async def wait(self) -> None:
        """Until the loop ends; raises if it crashed."""
        if self.task is not None:
            await asyncio.shield(self.task)

    async def _run(self) -> None:
        interval = self._config().interval
        failures = 0
        while True:
            began = time.monotonic()
            try:
                await self._round()
            except Exception as exc:  # a bug or an unexpected reply: report, back off, go on
                failures += 1
                self.failures += 1
                self.last_failure = f"{type(exc).__name__}: {exc}"[:300]
                log.error("agent %s: gossip round failed (%d in a row); retrying", self._config().region,
                          failures, exc_info=exc)
                await asyncio.sleep(min(30.0, interval * 2 ** min(failures, 10)))
                continue
            failures = 0
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.crashed = f"{type(exc).__name__}: {exc}"
            log.error("agent %s: gossip loop crashed", self._config().region, exc_info=exc)

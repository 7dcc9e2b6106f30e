"""An engine clock that notices the host's clock stepping back, for the gossip and escrow engines.

The engines keep times on the wall clock (``time.time``: the workers of one host compare
them through Redis). When it steps back by D seconds (an NTP step), every time recorded
before is D seconds in the future: a peer's last delta looked newer than now (ages below
zero: a peer silent after the step stayed current for D seconds), and backoffs, heartbeats
and pulls waited D seconds longer. :class:`SteppedClock` checks every reading against the
one before; on a step back of more than :data:`CLOCK_STEP_BACK` it calls ``on_step(by)``
(which moves the recorded times by ``by``, negative) before it returns, so a time recorded
after the step is never moved twice. A step forward makes peers look older for a moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["CLOCK_STEP_BACK", "SteppedClock"]

log = logging.getLogger("geolimit.gossip")

#: A reading this much (seconds) below the one before is a step back, not jitter.
CLOCK_STEP_BACK = 0.5


class SteppedClock:
    """Wraps ``clock``; ``on_step(by)`` runs once per step back, before the reading is returned."""

    def __init__(self, clock: Callable[[], float], on_step: Callable[[float], None], name: str) -> None:
        self._clock = clock
        self._on_step = on_step
        self._name = name
        self._seen: float | None = None
        self.steps = 0

    def __call__(self) -> float:
        now = self._clock()
        seen, self._seen = self._seen, now
        if seen is not None and now < seen - CLOCK_STEP_BACK:
            self.steps += 1
            log.warning("%s: the clock stepped back %.3f s; the times recorded for the peers move back with it",
                        self._name, seen - now)
            self._on_step(now - seen)
        return now

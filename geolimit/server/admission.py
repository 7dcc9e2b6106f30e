"""Admission control for the decision API: a bound on the checks an agent process has in progress.

An agent decides, merges its peers' gossip and runs its own gossip rounds on one event loop.
Offered more ``/v1/check`` calls than it can decide, it used to accept them all: with 4000
in flight one agent held 3-6 s of queued decisions, its gossip rounds fell from 10 to 1-3 a
second, and its peers' counts in its Redis grew older than ``partition_after`` (and its own in
theirs), so both sides applied the partition policy (``local``: each enforces the whole limit)
to regions that were in contact (docs/design.md §14, *Overload*).

:class:`CheckGate` holds at most ``[region] max_checks_in_progress`` checks (a batch counts
each of its checks) between reading a request's body and answering it. A request that arrives
while that many are in progress is answered at once with 503, ``Retry-After`` and ``{"error",
"reason": "overloaded"}``, before its body is read: the agent's clients (the proxy, the middlewares,
:class:`~geolimit.http.agent_client.AgentClient`) treat that as the agent being unavailable and
apply their ``on_error``. A batch is taken whole while there is room (so one of up to
``MAX_BATCH`` checks is never starved by a smaller bound): the checks in progress may exceed the
bound by at most one batch.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

__all__ = ["DEFAULT_MAX_CHECKS", "OVERLOAD_RETRY_AFTER", "CheckGate"]

#: Checks in progress per agent process by default: two of the limiter's batches of 128 at Redis
#: (geolimit/async_limiter.py) and as many waiting, about 0.1-0.3 s of work on this machine.
DEFAULT_MAX_CHECKS = 512
#: Seconds an overloaded agent asks a client to wait (``Retry-After``, whole seconds).
OVERLOAD_RETRY_AFTER = 1


class CheckGate:
    """Counts the checks in progress against a bound read at each request (SIGHUP changes it)."""

    def __init__(self, bound: Callable[[], int], shed: Callable[[], None] | None = None) -> None:
        self._bound = bound
        self._shed = shed or (lambda: None)
        self.in_progress = 0
        self.shed = 0  # requests answered 503 so far

    @property
    def bound(self) -> int:
        return self._bound()

    def full(self) -> bool:
        """Whether a request must be refused now (the bound is reached)."""
        return self.in_progress >= self._bound()

    def enter(self, checks: int) -> bool:
        """Take ``checks`` places; False (counted as shed) when the bound was reached meanwhile."""
        if self.full():
            self.refuse()
            return False
        self.in_progress += checks
        return True

    def leave(self, checks: int) -> None:
        self.in_progress -= checks

    def refuse(self) -> None:
        """Count one request answered 503."""
        self.shed += 1
        self._shed()

    def overloaded(self) -> web.Response:
        """The 503 answer to a request that does not fit."""
        return web.json_response(
            {"error": f"the agent has {self.in_progress} checks in progress (region.max_checks_in_progress "
                      f"{self._bound()}): retry later or apply on_error", "reason": "overloaded"},
            status=503, headers={"Retry-After": str(OVERLOAD_RETRY_AFTER)})

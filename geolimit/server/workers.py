"""Several agent worker processes per region (``geolimit agent --workers N``).

One Python process caps a region at about one core. With ``workers = N`` the
``geolimit agent`` process becomes a :class:`Supervisor` that starts N worker
processes (``python -m geolimit agent --config PATH --workers N --worker-index
I``); each is an ordinary :class:`~geolimit.server.agent.Agent` that:

* owns the virtual shards ``{s : s % N == I}`` (:func:`owned_shards`): it
  drains, packs, sends and recovers only their outboxes, while it merges cells
  of any shard that peers send it;
* binds the same listen addresses as the others with ``SO_REUSEPORT``, so the
  kernel spreads API and gossip connections over the workers;
* initiates anti-entropy only if it is worker 0 (every worker serves the
  exchanges peers start; an exchange's steps follow one pinned connection);
  what the others learn that needs an exchange (a wipe of shards they own, a
  peer's report of a link down, a refused batch, a peer back after failures)
  they hand to worker 0 through the region's Redis
  (geolimit/replication/ae_requests.py), which starts it at its next round;
* signs with sequence numbers of its own residue class modulo N
  (:class:`WorkerSigner`), so two workers never send the same (region, seq)
  pair, which the peers' replay guard would refuse;
* stops (flushing, as on SIGTERM) when its supervisor disappears
  (:func:`watch_parent`);
* shares its metrics with the other workers, so that one ``/metrics`` scrape
  describes the whole region (geolimit/worker_metrics.py).

The supervisor (the generic one of geolimit/supervisor.py, shared with
``geolimit proxy --workers N``) forwards SIGTERM/SIGINT (graceful stop) and SIGHUP (reload) to
every worker, restarts a worker that exits on its own after an exponential
backoff (logged as an error), and gives up, stopping the others and exiting
1, when one worker crashes ``max_crashes`` times within ``crash_window``
seconds. Nothing is lost when a worker dies: outboxes and in-flight batches
live in Redis, and the restarted worker returns its shards' in-flight batches
to their outboxes before it sends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from geolimit.errors import ConfigError
from geolimit.replication.auth import Signer
from geolimit.server.config import MAX_WORKERS
from geolimit.supervisor import Supervisor as _Supervisor
from geolimit.supervisor import describe_exit, watch_parent

__all__ = ["MAX_WORKERS", "Supervisor", "WorkerSigner", "describe_exit", "owned_shards", "watch_parent"]


def owned_shards(shards: int, index: int, workers: int) -> list[int]:
    """The shards worker ``index`` of ``workers`` drains and sends: ``s % workers == index``."""
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} is not in [0, {workers})")
    return list(range(index, shards, workers))


class WorkerSigner(Signer):
    """A :class:`Signer` whose sequence numbers are ``index`` modulo ``workers``.

    Every worker of a region signs as that region, and a peer's replay guard
    refuses a (region, seq) pair it has seen. Sequence numbers are microsecond
    times, so two workers could pick the same one; taking disjoint residue
    classes makes that impossible, and they still increase across restarts.
    """

    def __init__(self, secret: bytes, region: str, clock: Callable[[], float] = time.time, *,
                 index: int, workers: int) -> None:
        super().__init__(secret, region, clock)
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} is not in [0, {workers})")
        self.index, self.workers = index, workers
        self._now = clock
        self._last = 0

    def next_seq(self) -> int:
        seq = max(self._last + 1, int(self._now() * 1_000_000))
        seq += (self.index - seq) % self.workers
        self._last = seq
        return seq


class Supervisor(_Supervisor):
    """The supervisor of ``geolimit agent --workers N`` (see :class:`geolimit.supervisor.Supervisor`).

    Each worker stops with ``--flush-timeout flush_timeout``; log messages name
    the ``region``; ``listens`` are the region's listen addresses, bound once before
    any worker starts.
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        workers: int,
        *,
        region: str = "?",
        flush_timeout: float = 2.0,
        stop_timeout: float = 20.0,
        max_crashes: int = 5,
        crash_window: float = 60.0,
        first_backoff: float = 0.5,
        max_backoff: float = 10.0,  # below the 15 s change lease: a short outage loses no change marks
        command: Sequence[str] | None = None,
        listens: Sequence[tuple[str, tuple[str, int]]] = (),
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be from 1 to {MAX_WORKERS}, got {workers!r}")
        super().__init__("agent", config_path, workers, name=f"agent {region}",
                         args=("--flush-timeout", repr(flush_timeout)), stop_timeout=stop_timeout,
                         max_crashes=max_crashes, crash_window=crash_window, first_backoff=first_backoff,
                         max_backoff=max_backoff, command=command, listens=listens)
        self.region = region
        self.flush_timeout = flush_timeout

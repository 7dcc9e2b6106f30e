"""Peers' freshness for the shards of a worker that is down (``geolimit agent --workers N``).

Each worker publishes how fresh the peers' counts are for the shards it owns
(``drain.lua``), and decisions on a shard treat a peer as partitioned once that is
older than ``partition_after``. While a worker is down (killed, restarting with
backoff, crash-looping) nobody published for its shards, so for 0.8-1.5 s per
``kill -9`` (up to about 10 s for a worker that crash-loops) they denied ``closed``
rules and reserved ``share`` rules' room with every peer healthy. Now every worker
stamps its own entry in the region's shared hash each round (heard.py, ``#w<i>``),
and the lowest-numbered live worker publishes for the shards of the workers whose
stamp is older than :func:`stale_after` (``freshen.lua``: a field only moves
forward, so a worker that is merely slow loses nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from geolimit.core.keys import KeyLayout
from geolimit.store.async_store import AsyncStore, checked_replies
from geolimit.store.scripts import load_script

__all__ = ["FreshnessTakeover", "down_workers", "stale_after", "worker_field"]

_FRESHEN = load_script("freshen")


def worker_field(index: int) -> str:
    """The shared hash's field of worker ``index``'s last round (region names have no '#')."""
    return f"#w{index}"


def stale_after(interval: float, heartbeat: float) -> float:
    """Seconds after its last round that a worker counts as down: two and a half rounds, and
    at least a heartbeat (a quarter of the shortest watched ``partition_after``, peers.py).

    A peer's freshness on the dead worker's shards is already up to about a heartbeat, two
    intervals and a round trip old when it stops; it keeps ageing until the takeover's first
    publish. With 0.5 s here, real processes showed peaks of 0.71-0.97 s (23 kills) against
    the default ``partition_after`` of 1 s; with the defaults this is 0.25 s. Taking over a
    worker that is only slow costs a few script calls and changes nothing (fields only move
    forward)."""
    return max(2.5 * interval, heartbeat)


def down_workers(stamps: Mapping[int, float | None], now: float, interval: float, heartbeat: float,
                 workers: int, index: int) -> frozenset[int]:
    """The workers other than ``index`` whose last round (``stamps``: index -> engine-clock
    seconds, None or missing: never seen) is older than :func:`stale_after`."""
    limit = stale_after(interval, heartbeat)
    return frozenset(i for i in range(workers) if i != index
                     and (stamps.get(i) is None or now - (stamps[i] or 0.0) > limit))


class FreshnessTakeover:
    """Publishes peers' freshness for other workers' shards."""

    def __init__(self, store: AsyncStore, layout: KeyLayout, index: int, workers: int) -> None:
        self.store = store
        self.layout = layout
        self.index = index
        self.workers = workers

    def orphans(self, stamps: Mapping[int, float | None], now: float, interval: float,
                heartbeat: float) -> list[int]:
        """The shards this worker publishes for: those of the workers whose last round
        (``stamps``: index -> engine-clock seconds, None: never seen) is stale, if this is
        the lowest-numbered worker that is not."""
        down = down_workers(stamps, now, interval, heartbeat, self.workers, self.index)
        if not down or any(i < self.index and i not in down for i in range(self.workers)):
            return []
        return [s for s in range(self.layout.shards) if s % self.workers in down]

    async def publish(self, shards: Sequence[int], ages_us: Mapping[str, int], correction_us: int,
                      clock_arg: bytes) -> int:
        """Move the peers' freshness of ``shards`` forward to ``ages_us`` (µs old as of now);
        the fields moved."""
        if not shards or not ages_us:
            return 0
        tail = [clock_arg, b"%d" % correction_us]
        for peer, age in ages_us.items():
            tail += [peer.encode(), b"%d" % age]
        calls = [[b"1", self.layout.aux_keys(s)[2], *tail] for s in shards]
        return sum(int(r) for r in checked_replies(await self.store.run_many(_FRESHEN, calls)))

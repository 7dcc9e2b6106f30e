"""When each peer's deltas last reached this region, shared by its agent workers.

A peer's counts are as old as its last delta here (``GossipEngine.peer_ages``), and
every worker publishes that age for the shards it owns (``drain.lua``). With
``geolimit agent --workers N`` a peer's deltas reach whichever worker accepted their
connection, so a worker may hear from a peer only through the others: each round
every worker adds its own times to a hash in the region's Redis (``heard.lua``: the
larger time wins, one hash on shard 0's tag with a TTL) and takes the others'. The
workers of one host share its clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from geolimit.core.keys import KeyLayout
from geolimit.store.async_store import AsyncStore
from geolimit.store.scripts import load_script

__all__ = ["HEARD_MARGIN", "HEARD_TTL_MS", "SharedHeard", "stamp_seconds"]

_HEARD = load_script("heard")
#: The hash outlives the workers' silence by this long (then every peer counts as never heard).
HEARD_TTL_MS = 3_600_000
#: A shared time further ahead of the caller's clock than this (seconds) is not one a worker
#: of this host wrote since: junk, or written before the clock stepped back. It is dropped:
#: kept (the larger time wins), it would make the peer look current for as long as it stays.
HEARD_MARGIN = 1.0
_MAX_DIGITS = 16  # µs since 1970 until the year 2286; int() of a longer string can fail


def stamp_seconds(raw: object) -> float | None:
    """A time the workers wrote (µs, ``%d``) as seconds, or None for anything else (junk
    in the region's shared keys: not bytes, not plain digits, or too long to be a time)."""
    if isinstance(raw, bytes) and len(raw) <= _MAX_DIGITS and raw.isdigit():
        return int(raw) / 1e6
    return None


class SharedHeard:
    """The region's hash of peer -> when its last delta reached a worker."""

    def __init__(self, store: AsyncStore, layout: KeyLayout) -> None:
        self.store = store
        self.key = layout.tag(0) + b"#hd"

    async def exchange(self, mine: Mapping[str, float | None], now: float) -> dict[str, float]:
        """Record ``mine`` (peer -> engine-clock seconds, None: never) and return the
        latest time any worker recorded per peer of ``mine``, up to ``now`` (the engine
        clock) and :data:`HEARD_MARGIN`."""
        limit = now + HEARD_MARGIN
        peers = list(mine)
        args = [b"1", self.key, b"%d" % HEARD_TTL_MS, b"%d" % int(limit * 1_000_000)]
        for peer in peers:
            when = mine[peer]
            args += [peer.encode(), b"" if when is None else b"%d" % int(when * 1_000_000)]
        reply = await self.store.run(_HEARD, args)
        latest: dict[str, float] = {}
        for peer, value in zip(peers, list(reply or ()), strict=False):
            when = stamp_seconds(value)
            if when is not None and when <= limit:
                latest[peer] = when
        return latest

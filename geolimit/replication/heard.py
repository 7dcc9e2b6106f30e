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

__all__ = ["HEARD_TTL_MS", "SharedHeard"]

_HEARD = load_script("heard")
#: The hash outlives the workers' silence by this long (then every peer counts as never heard).
HEARD_TTL_MS = 3_600_000


class SharedHeard:
    """The region's hash of peer -> when its last delta reached a worker."""

    def __init__(self, store: AsyncStore, layout: KeyLayout) -> None:
        self.store = store
        self.key = layout.tag(0) + b"#hd"

    async def exchange(self, mine: Mapping[str, float | None]) -> dict[str, float]:
        """Record ``mine`` (peer -> engine-clock seconds, None: never) and return the
        latest time any worker recorded per peer of ``mine``."""
        args = [b"1", self.key, b"%d" % HEARD_TTL_MS]
        for peer, when in mine.items():
            if when is not None:
                args += [peer.encode(), b"%d" % int(when * 1_000_000)]
        reply = await self.store.run(_HEARD, args)
        flat = list(reply or ())
        latest: dict[str, float] = {}
        for name, value in zip(flat[::2], flat[1::2], strict=False):
            if not isinstance(name, bytes) or not isinstance(value, bytes) or not value.isdigit():
                continue
            peer = name.decode(errors="replace")
            if peer in mine:
                latest[peer] = int(value) / 1e6
        return latest

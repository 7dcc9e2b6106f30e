"""Anti-entropy requests between the agent workers of one region.

With ``geolimit agent --workers N`` only worker 0 starts anti-entropy exchanges
(geolimit/server/workers.py), but any worker may learn that one is needed: it
finds that Redis lost the data of shards it owns (a Redis Cluster node that lost
only those), a peer reports a link down to it, a peer refuses its batch, or a
peer answers it again after failures. Such a worker leaves a request in the
region's Redis (``repair_request.lua``: a list on shard 0's tag, bounded and with a
TTL), and worker 0 takes the requests at its next round and starts the
exchanges as if it had learned it itself. Before, only worker 0's own findings
started one, and the others' waited for the next periodic exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from geolimit.core.keys import KeyLayout
from geolimit.replication.heard import stamp_seconds
from geolimit.store.async_store import AsyncStore
from geolimit.store.scripts import load_script

__all__ = ["MAX_REQUESTS", "REQUEST_TTL_MS", "AntiEntropyRequests", "Request"]

_AE_REQUEST = load_script("repair_request")
#: Requests kept (the oldest go first) and taken per round: more than any region has peers.
MAX_REQUESTS = 256
#: Requests not taken within this long (worker 0 is down that long) expire with the list:
#: worker 0's start-up exchanges cover them.
REQUEST_TTL_MS = 3_600_000
_AFTER_WIPE, _PLAIN = b"w", b"n"


@dataclass(frozen=True)
class Request:
    """What the workers asked for one peer: ``after_wipe`` (an exchange that repairs a wipe
    of our Redis), and when the latest request was posted (engine clock, seconds)."""

    after_wipe: bool
    posted: float


class AntiEntropyRequests:
    """The region's request list: :meth:`post` by any worker, :meth:`take` by the initiator."""

    def __init__(self, store: AsyncStore, layout: KeyLayout) -> None:
        self.store = store
        self.key = layout.ae_requests_key

    async def post(self, wanted: Mapping[str, bool], now: float) -> None:
        """Ask for an exchange with each peer in ``wanted`` (True: it repairs a wipe of our
        Redis), as of ``now`` (the engine clock, seconds)."""
        if not wanted:
            return
        stamp = b"%d" % int(now * 1_000_000)
        entries = [(_AFTER_WIPE if wipe else _PLAIN) + b":" + stamp + b":" + peer.encode()
                   for peer, wipe in wanted.items()]
        await self.store.run(_AE_REQUEST, [b"1", self.key, b"push", b"%d" % REQUEST_TTL_MS, b"%d" % MAX_REQUESTS,
                                           *entries])

    async def take(self, peers: Iterable[str]) -> dict[str, Request]:
        """The requests left since the last take, for the peers in ``peers`` (others, and
        entries that are not requests, are dropped), merged per peer."""
        known = set(peers)
        reply = await self.store.run(_AE_REQUEST, [b"1", self.key, b"take", b"%d" % MAX_REQUESTS])
        taken: dict[str, Request] = {}
        for entry in reply or ():
            if not isinstance(entry, bytes):
                continue
            flag, _, rest = entry.partition(b":")
            stamp, _, name = rest.partition(b":")
            peer = name.decode(errors="replace")
            posted = stamp_seconds(stamp)
            if peer not in known or flag not in (_AFTER_WIPE, _PLAIN) or posted is None:
                continue
            had = taken.get(peer)
            after_wipe = flag == _AFTER_WIPE
            taken[peer] = Request(after_wipe or (had is not None and had.after_wipe),
                                  max(posted, had.posted) if had else posted)
        return taken

"""The agreed region clock: every region runs its decisions on the mean of the regions' clocks.

Buckets are aligned to the epoch clock, so a region whose clock runs ahead
writes its hits into buckets its peers have not reached yet, and one that runs
behind into buckets that leave their windows early: ±1 s of skew at 1 s
buckets let the regions together over-admit by about 19% in the worst window.
NTP keeps hosts closer than that, but not every fleet runs it well.

Each agent estimates every peer's clock offset from its exchanges with it
(``PeerState.skew``, the peer's clock minus ours: the answer's time minus the
exchange's midpoint, from the least-delayed of the last exchanges; see
``Receiver.note_clock_sample``). The mean offset over all regions, this one counting 0, is
the correction that moves this region's clock onto the mean of all clocks:
region ``i`` estimates ``c_j - c_i`` for every ``j``, so ``c_i + mean_j(c_j - c_i)
= mean_j(c_j)``, the same time in every region. The agent stores the
correction in every shard registry (field ``k``, by ``drain.lua`` each round),
and the scripts add it to their clock for everything that names buckets:
decisions, merges, resets, peer freshness. Escrow rules (whose guarantee needs
only the region's own clock to be monotonic), leases and outbox times keep the
unmodified clock. Offsets are measured between unmodified clocks (the messages
carry those), so the correction does not feed back into its own estimate.

A peer never heard from counts at offset 0 until its first message, and one
unreachable keeps its last estimate (clocks drift slowly).
"""

from __future__ import annotations

from collections.abc import Iterable

from geolimit.errors import ConfigError

__all__ = ["MAX_CORRECTION", "agreed_correction"]

#: The largest correction applied (seconds). Peers further off are refused by
#: the gossip authentication window anyway (30 s by default).
MAX_CORRECTION = 60.0


def agreed_correction(offsets: Iterable[float], regions: int) -> float:
    """The correction (seconds) that moves this region's clock onto the mean of all regions' clocks.

    ``offsets``: each known peer's clock minus this region's (seconds);
    ``regions``: every configured region, this one included (peers not yet
    measured count at offset 0).
    """
    if regions < 1:
        raise ConfigError("regions must be at least 1")
    return max(-MAX_CORRECTION, min(MAX_CORRECTION, sum(offsets) / regions))

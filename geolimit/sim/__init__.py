"""Deterministic multi-region simulation: virtual time, an in-memory network, real Lua
(and escrow mode's pure model between simulated regions)."""

from geolimit.sim.cluster import SimCluster, SimRegion
from geolimit.sim.escrow import EscrowCluster, EscrowRegion
from geolimit.sim.network import Faults, SimNetwork, SimTransport
from geolimit.sim.scheduler import Scheduler, SkewedClock

__all__ = [
    "EscrowCluster", "EscrowRegion", "Faults", "Scheduler", "SimCluster", "SimNetwork", "SimRegion", "SimTransport",
    "SkewedClock",
]

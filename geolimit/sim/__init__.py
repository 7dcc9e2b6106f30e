"""Deterministic multi-region simulation: virtual time, an in-memory network, real Lua."""

from geolimit.sim.cluster import SimCluster, SimRegion
from geolimit.sim.network import Faults, SimNetwork, SimTransport
from geolimit.sim.scheduler import Scheduler, SkewedClock

__all__ = ["Faults", "Scheduler", "SimCluster", "SimNetwork", "SimRegion", "SimTransport", "SkewedClock"]

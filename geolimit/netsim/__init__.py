"""Network simulation for tests and demos: a faulty TCP proxy and a faulty gossip transport.

* :class:`FaultyLink` - a loopback TCP proxy with per-direction latency/jitter,
  one-way black holes and full partitions (byte-level faults, real sockets).
* :class:`FaultyTransport` - a :class:`~geolimit.replication.transport.Transport`
  wrapper that drops, duplicates, reorders and partitions gossip messages per
  peer, driven by a seeded :class:`random.Random` (message-level faults).
"""

from geolimit.netsim.faults import FaultCounters, FaultyTransport, PeerFaults
from geolimit.netsim.link import DIRECTIONS, Direction, FaultyLink, Latency, LinkStats, NetsimError

__all__ = [
    "DIRECTIONS",
    "Direction",
    "FaultCounters",
    "FaultyLink",
    "FaultyTransport",
    "Latency",
    "LinkStats",
    "NetsimError",
    "PeerFaults",
]

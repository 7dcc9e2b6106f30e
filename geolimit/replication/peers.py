"""Per-peer state of the gossip engine and its tunables."""

from __future__ import annotations

from dataclasses import dataclass, field

from geolimit.replication.outbox import Outbox
from geolimit.replication.wire import Cell6

__all__ = ["EngineSettings", "PeerState"]


@dataclass(frozen=True)
class EngineSettings:
    interval: float = 0.1
    anti_entropy_interval: float = 30.0
    max_backoff: float = 0.2  # retries keep probing a failed peer this often, so a heal is noticed fast
    probe_cells: int = 200  # cells per attempt while a peer is failing
    outbox_limit: int = 1_000_000
    max_cells_per_message: int = 20_000  # bounds how long a peer spends merging one request
    heartbeat: float = 1.0  # send (possibly empty) deltas at least this often
    lease_ttl: float = 15.0
    relay_grace: int = 3  # intervals a deferred relay waits for the origin to deliver


@dataclass
class PeerState:
    name: str
    outbox: Outbox
    last_ok: float | None = None
    last_heard: float | None = None
    last_attempt: float | None = None
    failures: int = 0
    errors: int = 0
    last_error: str | None = None
    next_attempt: float = 0.0
    sending: bool = False
    reach: dict[str, float] = field(default_factory=dict)
    reach_at: float = 0.0
    ae_needed: bool = True
    ae_running: bool = False
    ae_due: float = 0.0
    ae_concluded: bool = False
    ae_ok: int = 0
    cells_sent: int = 0
    cells_received: int = 0
    rtt: float = 0.0  # smoothed round trip of our messages to this peer (seconds)
    skew: float = 0.0  # smoothed estimate of the peer's clock minus ours (seconds), for status
    deferred: list[tuple[float, str, float, list[Cell6]]] = field(default_factory=list)

    def acked_from(self, target: str) -> float | None:
        """When this peer last reported an acknowledgement from ``target`` (our clock)."""
        age = self.reach.get(target)
        return None if age is None else self.reach_at - age

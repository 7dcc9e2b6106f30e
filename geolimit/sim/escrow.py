"""Escrow mode between simulated regions, in virtual time (pure Python, no Redis).

Every region keeps, per subject, its own :class:`~geolimit.core.escrow.Ledger` and
its copy of the replicated :class:`~geolimit.core.escrow.EscrowState`. Every
gossip interval (at a per-region phase, as in :class:`~geolimit.sim.SimCluster`)
a region advertises, gives its row of the rebalance plan to the peers it has
heard from recently, and sends its whole state to every peer over the
:class:`~geolimit.sim.SimNetwork` links: one-way latency plus jitter, refused at
once when the link is cut, lost when it is cut while the message is in flight.
The receiver max-merges it.

    sim = EscrowCluster(["a", "b", "c"], limit=5, window=60.0, resolution=6.0)
    sim.start()
    sim.hit("a", b"user:1")
    await sim.advance(0.5)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from geolimit.core.clock import ManualClock
from geolimit.core.escrow import (
    EscrowDecision,
    EscrowState,
    Ledger,
    decide,
    merge,
    rebalance,
    rights,
)
from geolimit.sim.network import SimNetwork
from geolimit.sim.scheduler import Scheduler, SkewedClock, VirtualTime

__all__ = ["EscrowCluster", "EscrowRegion"]


@dataclass
class EscrowRegion:
    name: str
    clock: SkewedClock
    limit: int
    states: dict[bytes, EscrowState] = field(default_factory=dict)
    ledgers: dict[bytes, Ledger] = field(default_factory=dict)
    heard: dict[str, int] = field(default_factory=dict)  # peer -> local time (us) of its last message
    given: int = 0  # units of rights this region gave away, in total
    rounds: int = 0


class EscrowCluster(VirtualTime):
    """Regions running escrow mode for one rule, the links between them, virtual time."""

    def __init__(
        self,
        regions: Sequence[str],
        limit: int,
        window: float,
        resolution: float,
        *,
        interval: float = 0.1,
        latency: float = 0.05,
        jitter: float = 0.0,
        skew: dict[str, float] | None = None,
        start: float = 1_700_000_000.0,
        seed: int = 1,
        stale_after: float | None = None,
        minimum: int = 1,
        steps: int = 1,
    ) -> None:
        self.names = sorted(regions)
        self.window_us = round(window * 1e6)
        self.resolution_us = round(resolution * 1e6)
        self.interval_us = round(interval * 1e6)
        self.latency = latency
        self.clock = ManualClock(start)
        self.scheduler = Scheduler(self.clock)
        self.rng = random.Random(seed)
        self.network = SimNetwork(self.scheduler, latency, jitter, random.Random(seed + 1))
        # Rights given to a peer that cannot receive them are lost to everyone until it is
        # back: give only to peers heard from within three rounds and a round trip.
        self.stale_after_us = round((stale_after or 3 * interval + 2 * latency) * 1e6)
        self.minimum = minimum
        self.steps = steps
        skew = skew or {}
        self.regions = {n: EscrowRegion(n, SkewedClock(self.clock, skew.get(n, 0.0)), limit) for n in self.names}
        for name in self.names:
            self.network.receivers[name] = self.regions[name]
        self.gossip = True
        self._started = False

    def start(self) -> None:
        """Schedule every region's gossip rounds (the first at a random phase)."""
        if self._started:
            return
        self._started = True
        for i, name in enumerate(self.names):
            phase = round(self.rng.uniform(0, self.interval_us)) if i else 0
            self._schedule_round(name, self.clock.now_us() + phase)

    # -- decisions ------------------------------------------------------------------

    def ledger(self, region: str, subject: bytes) -> Ledger:
        r = self.regions[region]
        return r.ledgers.get(subject) or Ledger(self.window_us, self.resolution_us, self.steps)

    def state(self, region: str, subject: bytes) -> EscrowState:
        return self.regions[region].states.get(subject, EscrowState())

    def rights(self, region: str, subject: bytes) -> int:
        """``region``'s rights for ``subject`` as it knows them."""
        r = self.regions[region]
        return rights(self.state(region, subject), region, self.names, r.limit)

    def hit(self, region: str, subject: bytes, cost: int = 1) -> EscrowDecision:
        """A decision in ``region`` at the current virtual time."""
        r = self.regions[region]
        now = r.clock.now_us()
        wait = 2 * self.interval_us + 2 * round(self.latency * 1e6)
        decision, ledger = decide(
            self.ledger(region, subject), self.rights(region, subject), now, cost, r.limit, rights_wait_us=wait,
        )
        r.ledgers[subject] = ledger
        return decision

    def used(self, region: str, subject: bytes) -> int:
        r = self.regions[region]
        return self.ledger(region, subject).used(r.clock.now_us())

    def set_limit(self, region: str, limit: int) -> None:
        """A SIGHUP with a new limit in one region: its share changes, its transfers stay."""
        self.regions[region].limit = limit

    # -- gossip ---------------------------------------------------------------------

    def live_peers(self, region: str) -> set[str]:
        r = self.regions[region]
        now = r.clock.now_us()
        return {p for p, at in r.heard.items() if now - at <= self.stale_after_us}

    def _schedule_round(self, name: str, when_us: int) -> None:
        async def tick() -> None:
            if self.gossip:
                self.round(name)
            self._schedule_round(name, self.clock.now_us() + self.interval_us)

        self.scheduler.at(when_us, tick)

    def round(self, name: str) -> None:
        """One gossip round of ``name``: rebalance every subject, then send the state to every peer."""
        r = self.regions[name]
        r.rounds += 1
        now = r.clock.now_us()
        live = self.live_peers(name)
        for subject in set(r.states) | set(r.ledgers):
            state, given = rebalance(
                self.state(name, subject), name, self.names, r.limit, self.ledger(name, subject), now, live,
                self.minimum,
            )
            r.states[subject] = state
            r.given += sum(given.values())
        snapshot = dict(r.states)
        for peer in self.names:
            if peer != name:
                self._send(name, peer, snapshot)

    def _send(self, src: str, dst: str, states: dict[bytes, EscrowState]) -> None:
        net = self.network
        stats = net.link(src, dst)
        if net.is_cut(src, dst):
            stats.refused += 1
            return
        stats.messages += 1

        async def deliver() -> None:
            if net.is_cut(src, dst):
                stats.lost += 1
                return
            target = self.regions[dst]
            for subject, state in states.items():
                target.states[subject] = merge(target.states.get(subject, EscrowState()), state)
            target.heard[src] = target.clock.now_us()

        self.scheduler.at(self.clock.now_us() + net.delay_us(), deliver)

    # -- driving --------------------------------------------------------------------

    def agree(self) -> bool:
        """Do all regions hold the same transfers for every subject?"""
        subjects = {s for r in self.regions.values() for s in r.states}
        for subject in subjects:
            seen = {tuple(sorted(self.state(n, subject).transfers.items())) for n in self.names}
            if len(seen) > 1:
                return False
        return True

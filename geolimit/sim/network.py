"""An in-memory network between simulated agents, in virtual time.

Messages still go through the real wire encoding. Each direction of each link
has a one-way latency (plus jitter) and can be cut; a cut link refuses at once,
like a TCP connection refused, and a message in flight when a link is cut is lost.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from geolimit.replication import wire
from geolimit.replication.transport import TransportError
from geolimit.sim.scheduler import Scheduler

__all__ = ["Faults", "LinkStats", "SimNetwork", "SimTransport"]

Receiver = Callable[[wire.Message], "object"]


@dataclass
class LinkStats:
    messages: int = 0
    bytes: int = 0
    refused: int = 0
    lost: int = 0
    dropped: int = 0
    duplicated: int = 0


@dataclass(frozen=True)
class Faults:
    """Message-level faults of one direction of a link (probabilities).

    ``drop_request``: never delivered. ``drop_response``: delivered, but the
    sender sees an error and retries. ``duplicate``: delivered twice. Reordering
    comes from jitter: a message that draws a longer delay arrives after a later one.
    """

    drop_request: float = 0.0
    drop_response: float = 0.0
    duplicate: float = 0.0


@dataclass
class SimNetwork:
    scheduler: Scheduler
    latency: float = 0.05
    jitter: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(1))
    receivers: dict[str, object] = field(default_factory=dict)  # region -> engine (has .receive)
    cut_links: set[tuple[str, str]] = field(default_factory=set)
    stats: dict[tuple[str, str], LinkStats] = field(default_factory=dict)
    faults: dict[tuple[str, str], Faults] = field(default_factory=dict)

    def set_faults(self, a: str, b: str, faults: Faults, both: bool = True) -> None:
        self.faults[(a, b)] = faults
        if both:
            self.faults[(b, a)] = faults

    def _draw(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def delay_us(self) -> int:
        spread = self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return max(0, round((self.latency + spread) * 1_000_000))

    def cut(self, a: str, b: str, both: bool = True) -> None:
        self.cut_links.add((a, b))
        if both:
            self.cut_links.add((b, a))

    def heal(self, a: str, b: str, both: bool = True) -> None:
        self.cut_links.discard((a, b))
        if both:
            self.cut_links.discard((b, a))

    def isolate(self, region: str) -> None:
        for other in self.receivers:
            if other != region:
                self.cut(region, other)

    def rejoin(self, region: str) -> None:
        for other in self.receivers:
            if other != region:
                self.heal(region, other)

    def is_cut(self, a: str, b: str) -> bool:
        return (a, b) in self.cut_links

    def link(self, a: str, b: str) -> LinkStats:
        return self.stats.setdefault((a, b), LinkStats())

    def transport(self, region: str) -> SimTransport:
        return SimTransport(self, region)


class SimTransport:
    """One region's view of the simulated network (the engine's Transport)."""

    def __init__(self, network: SimNetwork, region: str) -> None:
        self.network = network
        self.region = region

    async def send(self, peer: str, message: wire.Message) -> wire.Message:
        net, src = self.network, self.region
        stats = net.link(src, peer)
        if net.is_cut(src, peer):
            stats.refused += 1
            raise TransportError(f"{peer} unreachable (simulated partition)")
        body = wire.encode(message)
        stats.messages += 1
        stats.bytes += len(body)
        faults = net.faults.get((src, peer), Faults())
        await net.scheduler.sleep_until(net.scheduler.clock.now_us() + net.delay_us())
        if net.is_cut(src, peer):
            stats.lost += 1
            raise TransportError(f"{peer}: message lost (partition while in flight)")
        if net._draw(faults.drop_request):
            stats.dropped += 1
            raise TransportError(f"{peer}: message dropped (simulated)")
        receiver = net.receivers[peer]
        reply = await receiver.receive(wire.decode(body))  # type: ignore[attr-defined]
        if net._draw(faults.duplicate):
            stats.duplicated += 1
            reply = await receiver.receive(wire.decode(body))  # type: ignore[attr-defined]
        back = wire.encode(reply)
        await net.scheduler.sleep_until(net.scheduler.clock.now_us() + net.delay_us())
        if net.is_cut(peer, src):
            net.link(peer, src).lost += 1
            raise TransportError(f"{peer}: reply lost (partition while in flight)")
        if net._draw(faults.drop_response):
            stats.dropped += 1
            raise TransportError(f"{peer}: reply dropped (simulated)")
        return wire.decode(back)

    async def close(self) -> None:
        return None

"""A simulated multi-region deployment: real Redis and Lua, virtual time.

Each region has its own Redis database (one redis-server, one DB per region;
on a Redis Cluster, ``redis+cluster://``, its own key prefix instead), its own clock (the shared virtual clock, optionally skewed), a real
:class:`~geolimit.AsyncLimiter` for decisions, and a real
:class:`~geolimit.replication.gossip.GossipEngine` talking over a
:class:`~geolimit.sim.network.SimNetwork`. Gossip rounds run every interval, at a
per-region phase, in virtual time.

    async with SimCluster("redis://127.0.0.1:6379", ["a", "b", "c"], [rule]) as sim:
        await sim.hit("a", "api", "user:1")
        await sim.advance(0.5)
        sim.network.isolate("c")
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.clock import ManualClock
from geolimit.core.decision import Decision
from geolimit.core.keys import glob_escape
from geolimit.core.rule import Rule
from geolimit.errors import ConfigError, StorageError
from geolimit.replication.gossip import EngineSettings, GossipEngine
from geolimit.replication.peers import heartbeat_for
from geolimit.replication.redis_io import ReplicationStore
from geolimit.sim.network import SimNetwork
from geolimit.sim.scheduler import Scheduler, SkewedClock, VirtualTime

__all__ = ["SimCluster", "SimRegion"]

log = logging.getLogger("geolimit.sim")


@dataclass
class SimRegion:
    name: str
    db: int  # the region's database, or on a cluster the number in its key prefix
    clock: SkewedClock
    limiter: AsyncLimiter
    store: ReplicationStore
    engine: GossipEngine
    gossip: bool = True


class SimCluster(VirtualTime):
    """Regions, their Redis databases, their agents and the network between them."""

    def __init__(
        self,
        redis_url: str,
        regions: Sequence[str],
        rules: Sequence[Rule],
        *,
        interval: float = 0.1,
        latency: float = 0.05,
        jitter: float = 0.0,
        skew: dict[str, float] | None = None,
        start: float = 1_700_000_000.0,
        replicate: bool = True,
        seed: int = 1,
        settings: dict[str, Any] | None = None,
        shards: int = 64,
    ) -> None:
        self.clustered = urlsplit(redis_url).scheme.endswith("+cluster")
        if len(regions) > 16 and not self.clustered:
            raise ConfigError("at most 16 simulated regions (one Redis database each)")
        self.redis_url = redis_url
        self.shards = shards
        self.names = list(regions)
        self.rules = tuple(rules)
        self.interval = interval
        self.replicate = replicate
        self.clock = ManualClock(start)
        self.scheduler = Scheduler(self.clock)
        self.rng = random.Random(seed)
        self.network = SimNetwork(self.scheduler, latency, jitter, random.Random(seed + 1))
        self.skew = dict(skew or {})
        # As the agent: an idle agent's heartbeat is set by the rules' partition_after.
        self.settings = EngineSettings(**{"interval": interval, "heartbeat": heartbeat_for(interval, rules),
                                          **(settings or {})})
        self.regions: dict[str, SimRegion] = {}

    def _limiter(self, name: str, db: int, clock: SkewedClock) -> AsyncLimiter:
        if self.clustered:
            url, prefix = self.redis_url, f"sim{db}"
        else:
            url, prefix = urlunsplit(urlsplit(self.redis_url)._replace(path=f"/{db}")), "gl"
        return AsyncLimiter.from_url(url, region=name, rules=self.rules, clock=clock, prefix=prefix, shards=self.shards)

    async def _clear(self, limiter: AsyncLimiter) -> None:
        """Delete all of a region's data: its database, or on a cluster its prefix's keys."""
        client = limiter.store.client()
        if not self.clustered:
            await client.flushdb()
            return
        prefix = glob_escape(limiter.layout.prefix.encode())
        for pattern in (prefix + b":*", prefix + b"#*"):
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
            for key in keys:
                await client.delete(key)

    async def __aenter__(self) -> SimCluster:
        for db, name in enumerate(self.names):
            clock = SkewedClock(self.clock, self.skew.get(name, 0.0))
            limiter = self._limiter(name, db, clock)
            await self._clear(limiter)
            self.regions[name] = self._region(name, db, clock, limiter)
        self.scheduler.watch(self._tasks)
        for i, name in enumerate(self.names):
            phase = self.rng.uniform(0, self.interval) if i else 0.0
            self._schedule_tick(name, self.clock.now_us() + round(phase * 1_000_000))
        return self

    def _region(self, name: str, db: int, clock: SkewedClock, limiter: AsyncLimiter) -> SimRegion:
        peers = [p for p in self.names if p != name]
        store = ReplicationStore(
            limiter.store, limiter.layout, name, limiter.rules, secrets.token_hex(3).encode(), now_us=clock.now_us,
            peers=peers,
        )
        engine = GossipEngine(name, peers, store, self.network.transport(name), self.settings, clock, random.Random(db))
        self.network.receivers[name] = engine
        return SimRegion(name, db, clock, limiter, store, engine, gossip=self.replicate)

    async def __aexit__(self, *exc: object) -> None:
        for region in self.regions.values():
            await region.engine.cancel()
            await region.limiter.aclose()

    def _tasks(self) -> list[asyncio.Task[object]]:
        out: list[asyncio.Task[object]] = []
        for region in self.regions.values():
            out.extend(region.engine.tasks)
        return out

    def _schedule_tick(self, name: str, when_us: int) -> None:
        async def tick() -> None:
            region = self.regions[name]
            if region.gossip:
                try:
                    await region.engine.round()
                except StorageError as exc:  # pragma: no cover - Redis is local
                    log.warning("sim: region %s round failed: %s", name, exc)
            self._schedule_tick(name, self.clock.now_us() + round(self.interval * 1_000_000))

        self.scheduler.at(when_us, tick)

    # -- driving ----------------------------------------------------------------

    async def hit(self, region: str, rules: str | Sequence[str], subject: str | bytes, cost: int = 1) -> Decision:
        """A decision in ``region`` at the current virtual time."""
        return await self.regions[region].limiter.hit(rules, subject, cost)

    async def wipe(self, region: str) -> None:
        """The region's Redis loses all its data (restart without persistence)."""
        await self._clear(self.regions[region].limiter)

    async def restart_agent(self, region: str) -> None:
        """The region's agent crashes and restarts: its memory (peer state) is gone; the
        outboxes and in-flight batches live in Redis and are picked up again."""
        old = self.regions[region]
        await old.engine.cancel()
        fresh = self._region(region, old.db, old.clock, old.limiter)
        fresh.gossip = old.gossip
        self.regions[region] = fresh

    async def views(self, rule: str, subject: str | bytes) -> dict[str, dict[str, int]]:
        """Each region's per-region usage of ``subject`` (what its apps would count)."""
        out: dict[str, dict[str, int]] = {}
        for name, region in self.regions.items():
            out[name] = (await region.limiter.usage(rule, subject)).by_region
        return out

    async def region_now_us(self, name: str, subject: str | bytes) -> int:
        """Region ``name``'s clock as its decisions on ``subject`` read it: its own clock
        plus the correction its agent stored in the subject's shard (the agreed clock)."""
        region = self.regions[name]
        layout = region.limiter.layout
        data = subject.encode() if isinstance(subject, str) else subject
        raw = await region.limiter.store.client().hget(layout.registry_key(layout.shard_of(data)), b"k")
        return region.clock.now_us() + (int(raw) if raw else 0)

    async def cells(self, name: str) -> dict[tuple[str, bytes], list[tuple[int, str, int, int]]]:
        """Every live cell region ``name`` holds (at its agreed clock)."""
        region = self.regions[name]
        return await region.store.read_live(round(region.engine.region_clock() * 1_000_000))

"""The demo's regions on loopback: one redis-server, one agent and the fault links of each.

Every ordered pair of regions ``(src, dst)`` gets its own :class:`FaultyLink`
forwarding to ``dst``'s agent, and ``src`` gossips to ``dst`` through it: requests
travel "up" the link, responses "down", each with the one-way latency. Isolating
a region partitions every link it sends or receives on, so it is cut off both ways
while the other regions still reach each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from geolimit.async_limiter import AsyncLimiter
from geolimit.core.rule import Rule
from geolimit.core.window import count_of
from geolimit.netsim import FaultyLink, Latency
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis

__all__ = ["REGION_NAMES", "Fleet", "region_names"]

log = logging.getLogger("geolimit.demo")

REGION_NAMES = ("us-east", "eu-west", "ap-south", "us-west", "eu-north", "ap-east", "sa-east", "af-south")
_PLACEHOLDER_URL = "http://127.0.0.1:9"  # replaced by the link's URL once the agents listen


def region_names(count: int) -> list[str]:
    """``count`` region names (familiar cloud regions, then ``r9``, ``r10``, ...)."""
    return [REGION_NAMES[i] if i < len(REGION_NAMES) else f"r{i + 1}" for i in range(count)]


class Fleet:
    """Regions on loopback. Servers start synchronously (``start_servers``), the rest in asyncio."""

    def __init__(
        self, names: Sequence[str], rule: Rule, *, latency: float, interval: float = 0.1, seed: int = 7
    ) -> None:
        self.names = list(names)
        self.rule = rule
        self.latency = latency
        self.interval = interval
        self._rng = random.Random(seed)
        self.servers: dict[str, EmbeddedRedis] = {name: EmbeddedRedis() for name in self.names}
        self.agents: dict[str, Agent] = {}
        self.apps: dict[str, AsyncLimiter] = {}
        self.links: dict[tuple[str, str], FaultyLink] = {}
        self.isolated: set[str] = set()
        self.problems: list[str] = []

    # -- redis-servers (sync: they are child processes) ---------------------------

    def start_servers(self) -> None:
        for server in self.servers.values():
            server.start()

    def stop_servers(self) -> None:
        for server in self.servers.values():
            try:
                server.stop()
            except Exception as exc:  # keep stopping the others
                self.problems.append(f"stopping redis-server: {exc}")

    def pids(self) -> dict[str, int]:
        return {name: server.pid for name, server in self.servers.items() if server.running}

    # -- agents, links, apps --------------------------------------------------------

    async def start(self) -> None:
        """Agents listen, links are wired between every ordered pair, gossip starts, apps connect."""
        secret = secrets.token_bytes(32)
        for name in self.names:
            peers = tuple(PeerConfig(p, _PLACEHOLDER_URL) for p in self.names if p != name)
            config = AgentConfig(
                region=name, redis_url=self.servers[name].url, listen=("127.0.0.1", 0), secret=secret,
                peers=peers, rules=(self.rule,), interval=self.interval, timeout=2.0,
            )
            agent = Agent(config)
            self.agents[name] = agent
            await agent.listen()
        jitter = self.latency / 10
        for src in self.names:
            for dst in self.names:
                if src == dst:
                    continue
                target = urlsplit(self.agents[dst].url)
                link = FaultyLink(
                    target.hostname or "127.0.0.1", target.port or 0, rng=random.Random(self._rng.random()),
                    up=Latency(self.latency, jitter), down=Latency(self.latency, jitter), name=f"{src}->{dst}",
                )
                self.links[(src, dst)] = link
                await link.start()
                self.agents[src].set_peer_url(dst, link.url)
        for agent in self.agents.values():
            await agent.start()
        for name in self.names:
            self.apps[name] = AsyncLimiter.from_url(self.servers[name].url, region=name, rules=[self.rule])

    async def wait_ready(self, timeout: float, stop: asyncio.Event) -> bool:
        """Until every agent has done its first anti-entropy with every peer (or ``stop``)."""
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            if all(agent.readiness()[0] for agent in self.agents.values()):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return False

    def isolate(self, name: str) -> None:
        """Cut ``name`` off from every peer, both ways."""
        self.isolated.add(name)
        for (src, dst), link in self.links.items():
            if name in (src, dst):
                link.partition()

    def heal(self, name: str) -> None:
        self.isolated.discard(name)
        for (src, dst), link in self.links.items():
            if name in (src, dst) and not (self.isolated & {src, dst}):
                link.heal()

    # -- observation ----------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        return self.agents[name].status()

    def failure(self, name: str) -> str | None:
        agent = self.agents.get(name)
        return None if agent is None else agent.failure()

    async def _cells(self, name: str, subject: bytes, now_us: int) -> list[tuple[int, str, int, int]]:
        engine = self.agents[name].engine
        if engine is None:
            return []
        live = await engine.store.read_live(now_us)
        return live.get((self.rule.name, subject), [])

    async def cells(self, name: str, subject: bytes, low: int, high: int, now_us: int) -> frozenset[tuple[int, str, int, int]]:
        """The cells ``(bucket, slot, value, floor)`` region ``name`` holds for ``subject``, low <= bucket < high."""
        return frozenset(c for c in await self._cells(name, subject, now_us) if low <= c[0] < high)

    async def view(self, name: str, subject: bytes, now_us: int) -> int:
        """The global count of the trailing window as region ``name`` sees it.

        Every region's counts that reached ``name``; the oldest bucket weighted by the
        part of it still inside the window, as approximate decisions do (assuming its
        traffic was uniform), so it compares with the exact trailing-window count.
        """
        resolution = self.rule.resolution_us
        current = now_us // resolution
        oldest = current - self.rule.buckets
        weight = ((current + 1) * resolution - now_us) / resolution
        total = 0.0
        for bucket, _slot, value, floor in await self._cells(name, subject, now_us):
            count = max(0, count_of(value) - count_of(floor))
            if oldest < bucket <= current:
                total += count
            elif bucket == oldest:
                total += count * weight
        return round(total)

    # -- shutdown -------------------------------------------------------------------

    async def close(self, flush_timeout: float = 0.5) -> None:
        """Close the apps, stop the agents (one flush each), stop the links. Never raises."""
        for name, app in self.apps.items():
            try:
                await asyncio.wait_for(app.aclose(), 5.0)
            except Exception as exc:
                self.problems.append(f"closing the app of {name}: {exc!r}")
        self.apps.clear()
        for name, agent in self.agents.items():
            try:
                await asyncio.wait_for(agent.stop(flush_timeout), flush_timeout + 15.0)  # STOP_GRACE and a busy machine
            except Exception as exc:
                self.problems.append(f"stopping the agent of {name}: {exc!r}")
                with contextlib.suppress(Exception):
                    await agent.abort()
        self.agents.clear()
        for (src, dst), link in self.links.items():
            try:
                await link.stop()
            except Exception as exc:
                self.problems.append(f"link {src}->{dst}: {exc!r}")
        self.links.clear()

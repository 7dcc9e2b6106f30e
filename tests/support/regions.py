"""Several real regions on loopback: one embedded redis-server and one agent each."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from geolimit import Limiter, ManualClock, Rule
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis

ServerFactory = Callable[..., EmbeddedRedis]


def dead_url() -> str:
    """An http URL where nothing listens (a partitioned peer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Region:
    name: str
    server: EmbeddedRedis
    config: AgentConfig
    agent: Agent
    clock: Any = None
    apps: list[Limiter] = field(default_factory=list)

    def app(self) -> Limiter:
        """A Python app of this region: a Limiter on the region's Redis (sharing the regions' clock)."""
        limiter = Limiter.from_url(self.server.url, region=self.name, rules=self.config.rules, clock=self.clock)
        self.apps.append(limiter)
        return limiter

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.server.url)


class Regions:
    """``async with Regions(factory, ["a", "b", "c"], rules) as rs: rs["a"].app().hit(...)``."""

    def __init__(
        self,
        server_factory: ServerFactory,
        names: Sequence[str],
        rules: Sequence[Rule],
        *,
        interval: float = 0.1,
        run_loops: bool = True,
        secret: bytes | None = None,
        clock: Any = None,
        **overrides: Any,
    ) -> None:
        self._factory = server_factory
        self.names = list(names)
        self.rules = tuple(rules)
        self.interval = interval
        self.run_loops = run_loops
        self.secret = secret or secrets.token_bytes(32)
        if clock is None and not run_loops:
            clock = ManualClock(time.time())
        self.clock = clock
        self.overrides = overrides
        self.regions: dict[str, Region] = {}
        self.urls: dict[str, str] = {}

    def __getitem__(self, name: str) -> Region:
        return self.regions[name]

    def _config(self, name: str, redis_url: str) -> AgentConfig:
        peers = tuple(PeerConfig(p, self.urls.get(p, "http://127.0.0.1:9")) for p in self.names if p != name)
        return AgentConfig(
            region=name, redis_url=redis_url, listen=("127.0.0.1", 0), secret=self.secret, peers=peers,
            rules=self.rules, interval=self.interval, **self.overrides,
        )

    async def __aenter__(self) -> Regions:
        for name in self.names:
            server = self._factory()
            config = self._config(name, server.url)
            agent = Agent(config, clock=self.clock)
            await agent.listen()
            self.urls[name] = agent.url
            self.regions[name] = Region(name, server, config, agent, clock=self.clock)
        for region in self.regions.values():
            for peer in self.names:
                if peer != region.name:
                    region.agent.set_peer_url(peer, self.urls[peer])
            region.config = replace(region.config, peers=tuple(PeerConfig(p, self.urls[p]) for p in self.names if p != region.name))
        if self.run_loops:
            for region in self.regions.values():
                await region.agent.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for region in self.regions.values():
            for app in region.apps:
                app.close()
            await region.agent.abort()

    async def restart_agent(self, name: str) -> Agent:
        region = self.regions[name]
        await region.agent.abort()
        config = replace(region.config, listen=("127.0.0.1", int(self.urls[name].rsplit(":", 1)[1])))
        region.agent = Agent(config, clock=self.clock)
        if self.run_loops:
            await region.agent.start()
        else:
            await region.agent.listen()
        return region.agent

    def cut(self, a: str, b: str) -> None:
        """Partition a and b from each other (both directions)."""
        self.regions[a].agent.set_peer_url(b, dead_url())
        self.regions[b].agent.set_peer_url(a, dead_url())

    def heal(self, a: str, b: str) -> None:
        self.regions[a].agent.set_peer_url(b, self.urls[b])
        self.regions[b].agent.set_peer_url(a, self.urls[a])

    async def step(self, rounds: int = 1, names: Sequence[str] | None = None) -> None:
        """Run gossip rounds by hand (agents created with run_loops=False).

        With a ManualClock, each round advances it by one gossip interval.
        """
        for _ in range(rounds):
            for name in names or self.names:
                await self.regions[name].agent.step()
            if isinstance(self.clock, ManualClock):
                self.clock.advance(self.interval)


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, what: str = "condition",
    pause: float = 0.01, explain: Callable[[], Awaitable[str] | str] | None = None,
) -> float:
    """Poll ``check`` until it is true; returns the seconds it took. After ``timeout`` the
    test fails, saying ``what`` was not reached (and ``explain()``, the state it was stuck in)."""
    started = time.monotonic()
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            detail = ""
            if explain is not None:
                told = explain()
                detail = f": {told if isinstance(told, str) else await told}"
            raise AssertionError(f"{what} not reached within {timeout}s{detail}")
        await asyncio.sleep(pause)


def dump_all(client: redis.Redis) -> dict[bytes, bytes]:
    """Every key's DUMP: byte-identical state comparison."""
    return {key: client.dump(key) for key in sorted(client.scan_iter(count=1000))}  # type: ignore[misc]

"""Regions on any Redis, one real agent each on loopback (like tests/support/regions.py).

A region's Redis is a :class:`Site`: a URL (``redis://`` or ``redis+cluster://``) and a
key prefix. Several regions may therefore share one Redis Cluster (every key of a
region starts with its prefix, and the hash tag ``{shard}`` comes after it, so the
regions' keys never collide), or one region can sit on the 3-master cluster while
the others use plain servers::

    sites = {"a": Site(cluster_url), "b": Site(server_b.url), "c": Site(server_c.url)}
    async with Mesh(sites, [rule]) as mesh:
        await mesh["a"].app.hit("api", "user:1")
        await mesh.until(converged, what="...")
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import redis.cluster

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.keys import KeyLayout, glob_escape
from geolimit.core.usage import Usage
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from tests.support.redis_provider import plain_url
from tests.support.regions import dead_url, eventually

__all__ = ["Member", "Mesh", "Site", "until"]

AnyRedis = redis.Redis | redis.cluster.RedisCluster


@dataclass(frozen=True)
class Site:
    """Where a region keeps its keys."""

    url: str
    prefix: str = "gl"

    @property
    def clustered(self) -> bool:
        return self.url.split("://", 1)[0].endswith("+cluster")

    def client(self) -> AnyRedis:
        """A sync client (bytes replies) on the whole site."""
        if self.clustered:
            return redis.cluster.RedisCluster.from_url(plain_url(self.url))
        return redis.Redis.from_url(self.url)

    def scan(self, pattern: bytes) -> list[bytes]:
        """Every key matching ``pattern`` (on every master of a cluster)."""
        client = self.client()
        try:
            return sorted(client.scan_iter(match=pattern, count=1000))
        finally:
            client.close()

    def wipe(self) -> int:
        """Delete every key of this site's prefix (a region's Redis losing its data); how many."""
        keys = [key for sep in (b":", b"#") for key in self.scan(glob_escape(self.prefix.encode() + sep) + b"*")]
        client = self.client()
        try:
            for key in keys:
                client.delete(key)
        finally:
            client.close()
        return len(keys)


@dataclass
class Member:
    name: str
    site: Site
    config: AgentConfig
    agent: Agent
    app: AsyncLimiter  # an app of the region: a limiter on the region's Redis
    layout: KeyLayout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = KeyLayout(self.site.prefix, self.config.shards)

    async def usage(self, rule: str, subject: str | bytes) -> Usage:
        return await self.app.usage(rule, subject)

    def queues(self) -> list[bytes]:
        """The keys of every replication queue still holding something: changed
        hashes, outboxes, in-flight slots and their lag markers."""
        prefix = self.site.prefix.encode()
        found: list[bytes] = []
        for suffix in (b"#c", b"#o:*", b"#f:*", b"#t:*"):
            found += self.site.scan(prefix + b":{*}" + suffix)
        return found


class Mesh:
    """``async with Mesh({"a": Site(...), ...}, rules) as mesh``: every region a peer of every other."""

    def __init__(
        self,
        sites: Mapping[str, Site],
        rules: Sequence[Rule],
        *,
        shards: int = 16,
        interval: float = 0.1,
        run_loops: bool = True,
        clock: ManualClock | None = None,
        **overrides: Any,
    ) -> None:
        self.sites = dict(sites)
        self.rules = tuple(rules)
        self.shards = shards
        self.interval = interval
        self.run_loops = run_loops
        self.clock = clock
        self.secret = secrets.token_bytes(32)
        self.overrides = overrides
        self.members: dict[str, Member] = {}

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    @property
    def names(self) -> list[str]:
        return list(self.sites)

    async def __aenter__(self) -> Mesh:
        try:
            for name, site in self.sites.items():
                config = AgentConfig(
                    region=name, redis_url=site.url, listen=("127.0.0.1", 0), secret=self.secret,
                    peers=tuple(PeerConfig(p, "http://127.0.0.1:9") for p in self.sites if p != name),
                    rules=self.rules, interval=self.interval, key_prefix=site.prefix, shards=self.shards,
                    **self.overrides,
                )
                agent = Agent(config, clock=self.clock)
                app = AsyncLimiter.from_url(site.url, region=name, rules=self.rules, prefix=site.prefix,
                                            shards=self.shards, clock=self.clock)
                self.members[name] = Member(name, site, config, agent, app)
                await agent.listen()
            urls = {name: m.agent.url for name, m in self.members.items()}
            for member in self.members.values():
                peers = tuple(PeerConfig(p, urls[p]) for p in self.sites if p != member.name)
                for peer in peers:
                    member.agent.set_peer_url(peer.name, peer.url)
                member.config = replace(member.config, peers=peers)
            if self.run_loops:
                for member in self.members.values():
                    await member.agent.start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for member in self.members.values():
            await member.agent.abort()
            await member.app.aclose()

    async def step(self, rounds: int = 1) -> None:
        """Gossip rounds by hand (run_loops=False); a ManualClock moves one interval a round."""
        for _ in range(rounds):
            for member in self.members.values():
                await member.agent.step()
            if self.clock is not None:
                self.clock.advance(self.interval)

    def ready(self) -> bool:
        return all(m.agent.readiness()[0] for m in self.members.values())

    def cut(self, a: str, b: str) -> None:
        """Partition a and b from each other (both directions)."""
        self.members[a].agent.set_peer_url(b, dead_url())
        self.members[b].agent.set_peer_url(a, dead_url())

    def heal(self, a: str, b: str) -> None:
        self.members[a].agent.set_peer_url(b, self.members[b].agent.url)
        self.members[b].agent.set_peer_url(a, self.members[a].agent.url)

    async def restart_agent(self, name: str) -> Agent:
        """A new agent process for region ``name``, on the same address (the old one is aborted)."""
        member = self.members[name]
        port = int(member.agent.url.rsplit(":", 1)[1])
        await member.agent.abort()
        member.agent = Agent(replace(member.config, listen=("127.0.0.1", port)), clock=self.clock)
        if self.run_loops:
            await member.agent.start()
        else:
            await member.agent.listen()
        return member.agent


async def until(
    check: Callable[[], Awaitable[bool] | bool], timeout: float, what: str, pause: float = 0.05,
    explain: Callable[[], Awaitable[str] | str] | None = None,
) -> float:
    """:func:`tests.support.regions.eventually`, polling every 50 ms by default."""
    return await eventually(check, timeout, what, pause, explain)

"""The cluster of bench/agents.py: one redis-server and one ``geolimit agent`` process per region,
their delay links in a process of their own (bench/_links.py). Split out of bench/agents.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _agents import (
    AgentProcess,
    die_with_parent,
    free_port,
    log_problems,
    statuses,
    stop_process,
    wait_agents_ready,
)
from _links import Links

from geolimit.core.rule import Rule
from geolimit.errors import ConfigError
from geolimit.server.run import CLOCK_OFFSET_ENV
from geolimit.sim.accuracy import Scenario
from geolimit.store.embedded import EmbeddedRedis
from geolimit.toml_config import parse_rules

ROOT = Path(__file__).resolve().parent.parent


# -- the cluster: redis-servers, delay links, agent processes -------------------------------


def rule_toml(s: Scenario, escrow: bool) -> str:
    """The scenario's rule as an agent's ``[[rule]]`` table (escrow: mode, prediction and partition
    policy do not apply)."""
    r = s.rule()
    lines = ["[[rule]]", f'name = "{r.name}"', f"limit = {r.limit}", f"window = {s.window!r}",
             f"resolution = {s.resolution!r}"]
    lines += ["escrow = true"] if escrow else [
        f'mode = "{r.mode}"', f"predict = {str(r.predict).lower()}", f'partition = "{r.partition}"',
        f"partition_after = {r.partition_after!r}"]
    return "\n".join(lines) + "\n"


def escrow_unavailable() -> str | None:
    """Why the escrow variant cannot run yet, or None."""
    options: dict[str, Any] = {"escrow": True}
    try:
        Rule("api", 5, 60.0, **options)
    except TypeError:
        return "Rule does not accept escrow=True yet"
    try:
        parse_rules([{"name": "api", "limit": 5, "window": 60, "escrow": True}], "bench")
    except ConfigError as exc:
        return f"the agent's [[rule]] table does not take escrow yet ({exc})"
    return None


def spawn_agent(name: str, config: Path, port: int, clock_offset: float | None) -> AgentProcess:
    """``geolimit agent --config config``, logging next to its config, its clock ``clock_offset`` s off."""
    env = dict(os.environ)
    if clock_offset is not None:
        env[CLOCK_OFFSET_ENV] = repr(clock_offset)
    log = config.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "geolimit", "agent", "--config", str(config)], env=env, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )
    return AgentProcess(name, f"http://127.0.0.1:{port}", proc, log)


class Cluster:
    """One redis-server and one ``geolimit agent`` per region; every peer URL is a delay link."""

    def __init__(self, s: Scenario, folder: Path, escrow: bool) -> None:
        self.s, self.folder, self.escrow = s, folder, escrow
        self.redis: dict[str, EmbeddedRedis] = {}
        self.links: Links | None = None  # the delay links' process; (from, to): what `from` dials to reach `to`
        self.agents: list[AgentProcess] = []
        self.freshness: dict[str, Any] = {}  # per region: how old its peers' counts were (Links.stop)

    async def __aenter__(self) -> Cluster:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        s, secret = self.s, self.folder / "gossip.key"
        secret.touch(mode=0o600)
        secret.write_text(os.urandom(32).hex() + "\n")
        ports = {name: free_port() for name in s.names}
        for name in s.names:
            self.redis[name] = await asyncio.to_thread(EmbeddedRedis().start)
        # In a process of their own: a load generator that falls behind must not delay gossip (bench/_links.py).
        self.links = Links([(a, b, ports[b]) for a in s.names for b in s.names if a != b], s.latency)
        skew = dict(zip(s.names, s.skew, strict=True)) if s.skew else {}
        for name in s.names:
            peers = ", ".join(f'{{ name = "{b}", url = "{self.links.urls[name, b]}" }}' for b in s.names if b != name)
            config = self.folder / f"{name}.toml"
            config.write_text(
                f'[region]\nname = "{name}"\nredis_url = "{self.redis[name].url}"\n'
                f'listen = "127.0.0.1:{ports[name]}"\nsecret_file = "{secret}"\n'
                f"[gossip]\ninterval = {s.interval!r}\npeers = [{peers}]\n[log]\nlevel = \"WARNING\"\n"
                + rule_toml(s, self.escrow)
            )
            self.agents.append(spawn_agent(name, config, ports[name], skew.get(name)))
        await wait_agents_ready(self.agents, 60.0)
        await asyncio.sleep(3 * s.interval)  # a few gossip rounds with every peer
        if self.escrow:
            await self._escrow_released(60.0)

    def watch(self) -> None:
        """From now on, sample how old each region's view of its peers' counts is (bench/_links.py)."""
        if self.links is not None:
            self.links.send("watch " + json.dumps({"redis": {r: srv.url for r, srv in self.redis.items()},
                                                   "partition_after_ms": self.s.rule().partition_after * 1000}))

    async def _escrow_released(self, seconds: float) -> None:
        """Until no agent holds escrow state: a new Redis denies escrow rules until its
        agent has pulled every peer (one send timeout plus a pull), as in a deployment."""
        deadline = time.monotonic() + seconds
        while True:
            views = (await statuses(self.agents)).values()
            escrow = [v.get("escrow") or {} for v in views]
            if all(e.get("stats", {}).get("rounds", 0) >= 2 and e.get("held_shards") == 0 for e in escrow):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"escrow state still held after {seconds:.0f} s: {escrow}")
            await asyncio.sleep(0.2)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(asyncio.to_thread(stop_process, a.proc, 10.0) for a in self.agents))
        if self.links is not None:
            self.freshness = await asyncio.to_thread(self.links.stop)
        for server in self.redis.values():
            await asyncio.to_thread(server.stop)

    def cut(self, region: str, cut: bool) -> None:
        """Partition (or heal) every link to and from ``region``."""
        if self.links is not None:
            self.links.send(f"{'cut' if cut else 'heal'} {region}")

    def log_errors(self) -> int:
        return sum(log_problems(a.log)[0] for a in self.agents)

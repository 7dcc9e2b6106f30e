"""The delay links of bench/agents.py in a process of their own, and a watch on the regions' freshness.

The links carry every gossip message between the agents. In the load generator's process
they were delayed by as much as it fell behind: at ``--load 15`` its sends left seconds late
and the agents' contact with their peers grew to 40 s while they sat at 5-10% CPU, so each
region applied its partition policy (``local``: the whole limit each). Here they keep their
own event loop.

The same process samples, every :data:`EVERY` s, how old each region's view of its peers'
counts is where decisions read it (the ``#p`` hash drain.lua writes in shard 0, against the
Redis clock and the region's correction), so a report can say whether the regions looked
partitioned during a run.

    python bench/_links.py '{"links": [["r1", "r2", PORT], ...], "latency": 0.05}'

prints ``{"r1|r2": URL, ...}`` on one line, then reads commands on stdin, one a line:
``watch {"r1": REDIS_URL, ...}``, ``cut REGION``, ``heal REGION``, ``stop``; ``stop`` prints the
freshness figures as one JSON line (per region: samples, max age in ms, samples older than
``partition_after_ms``) and exits. It exits by itself when stdin closes (its parent died).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio
from _agents import die_with_parent

from geolimit.core.keys import KeyLayout
from geolimit.netsim import FaultyLink, Latency

EVERY = 0.25


class Links:
    """The parent's handle on a links process (bench/agents.py)."""

    def __init__(self, links: list[tuple[str, str, int]], latency: float) -> None:
        spec = json.dumps({"links": links, "latency": latency})
        # Killed with this process's (main) thread, as the agents are: a bench killed mid-run leaves none.
        self.proc = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     preexec_fn=die_with_parent)
        assert self.proc.stdout is not None
        try:
            self.urls: dict[tuple[str, str], str] = {tuple(k.split("|")): v
                                                     for k, v in json.loads(self.proc.stdout.readline()).items()}
        except ValueError:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the links process did not start") from None

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self) -> dict[str, Any]:
        """The freshness figures; the process ends."""
        figures: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            self.send("stop")
            assert self.proc.stdout is not None
            figures = json.loads(self.proc.stdout.readline() or b"{}")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return figures


class _Watch:
    """Samples each region's view of its peers' counts (shard 0's ``#p``, as hit.lua reads it)."""

    def __init__(self, redis_urls: dict[str, str], partition_after_ms: float) -> None:
        self.clients = {r: redis.asyncio.Redis.from_url(u) for r, u in redis_urls.items()}
        self.seen: dict[str, dict[str, Any]] = {
            r: {"samples": 0, "max_ms": 0, "over": 0, "partition_after_ms": partition_after_ms} for r in redis_urls}
        self.partition_after_ms = partition_after_ms
        reg, _, self.peers_key = KeyLayout("gl", 64).aux_keys(0)
        self.registry = reg

    async def sample(self) -> None:
        for region, client in self.clients.items():
            with contextlib.suppress(OSError, redis.RedisError, ValueError):
                seconds, micros = await client.time()
                now = seconds * 1_000_000 + micros + int(await client.hget(self.registry, "k") or 0)
                fresh = await client.hgetall(self.peers_key)
                ages = [(now - int(v)) / 1000 for k, v in fresh.items() if k != b"#R"]
                if ages:
                    s = self.seen[region]
                    s["samples"] += 1
                    s["max_ms"] = max(s["max_ms"], round(max(ages)))
                    s["over"] += max(ages) > self.partition_after_ms

    async def run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(EVERY)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.aclose()


async def _serve(spec: dict[str, Any]) -> None:
    delay = Latency(spec["latency"])
    links: dict[tuple[str, str], FaultyLink] = {}
    # The agents' ports were picked free and released, so the kernel may hand one to a link's
    # listener: that agent could not bind it, and the link would dial itself. Such a link is
    # started again (holding the bad one meanwhile, so that the port is not offered twice).
    taken = {port for _, _, port in spec["links"]}
    for a, b, port in spec["links"]:
        held: list[FaultyLink] = []
        link = await FaultyLink("127.0.0.1", port, up=delay, down=delay, name=f"{a}->{b}").start()
        while link.port in taken:
            held.append(link)
            link = await FaultyLink("127.0.0.1", port, up=delay, down=delay, name=f"{a}->{b}").start()
        for bad in held:
            await bad.stop()
        links[a, b] = link
    print(json.dumps({f"{a}|{b}": link.url for (a, b), link in links.items()}), flush=True)
    loop = asyncio.get_running_loop()
    watch: _Watch | None = None
    watcher: asyncio.Task[None] | None = None
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            command, _, arg = line.partition(" ")
            if command in ("", "stop"):
                break
            if command == "watch":
                args = json.loads(arg)
                watch = _Watch(args["redis"], args["partition_after_ms"])
                watcher = asyncio.create_task(watch.run())
            for pair, link in links.items():
                if command in ("cut", "heal") and arg in pair:
                    link.partition() if command == "cut" else link.heal()
    finally:
        if watch is not None and watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await watch.sample()  # at least one sample, however short the run
            await watch.close()
        for link in links.values():
            await link.stop()
    print(json.dumps(watch.seen if watch is not None else {}), flush=True)


if __name__ == "__main__":
    asyncio.run(_serve(json.loads(sys.argv[1])))

"""`geolimit agent --workers 2`: real supervisor and worker processes, two regions, real redis-servers.

Each region runs a supervisor and two workers sharing one port (SO_REUSEPORT).
The test client opens a new connection per request, so the kernel spreads
them over the workers; ``/v1/status`` and ``/metrics`` say which one answered.
Stopping, crashes, ports and bad values: test_workers_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import JSON, AgentProcess
from tests.server.workers_support import (
    alive,
    all_ready,
    converged,
    every_worker_reports,
    hit,
    make_regions,
    start,
    statuses,
    stop,
)


async def test_two_workers_share_the_port_serve_decisions_replicate_exactly_and_reload(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    redis = {name: redis_server_factory() for name in "ab"}
    regions = make_regions(tmp_path, redis, {"a": 2})  # a: workers in the TOML; b: on the command line
    a, b = regions["a"], regions["b"]
    await start(a, supervisors)
    await start(b, supervisors, "--workers", "2")
    seen = {r.name: await statuses(http, r, all_ready) for r in (a, b)}
    pids = {r: {i: s["worker"]["pid"] for i, s in seen[r].items()} for r in seen}
    for name in seen:
        assert {i: (s["worker"]["workers"], s["worker"]["shards"]) for i, s in seen[name].items()} == \
            {0: (2, 32), 1: (2, 32)}
        assert len(set(pids[name].values()) | {regions[name].proc.pid}) == 3  # type: ignore[union-attr]

    hits_a: Counter[str] = Counter()
    hits_b: Counter[str] = Counter()
    await hit(http, a, hits_a, [f"user:{i}" for i in range(60)], 4)
    await hit(http, b, hits_b, [f"user:{i}" for i in range(40, 100)], 3)
    await every_worker_reports(http, a, 240)  # each scrape counts the decisions of both workers
    await converged(http, b, "a", hits_a)
    await converged(http, a, "b", hits_b)

    # SIGHUP: every worker reloads the rules.
    a.config.write_text(a.config.read_text().replace('"100000/1h"', '"50000/1h"'))
    assert a.proc is not None
    mark = len(a.proc.lines)
    a.proc.proc.send_signal(signal.SIGHUP)
    for index in (0, 1):
        await a.proc.wait_for_log(rf"\[worker {index}\]: agent a: reloaded .* \(~api\)", after=mark)
    await statuses(http, a, lambda s: len(s) == 2 and all(x["rules"]["api"].startswith("50000/") for x in s.values()))

    await stop(a)
    await stop(b)
    gone = [pid for r in pids.values() for pid in r.values() if alive(pid)]
    assert not gone, f"workers still supervisors after their supervisor stopped: {gone}"


async def test_anti_entropy_exchanges_stay_on_the_worker_that_began_them(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    """Every step of an exchange reaches the responder worker holding its state (one pinned connection).

    Traffic keeps deltas flowing meanwhile: were the steps sent over the deltas'
    connections, they would land on either worker of the peer and most runs would
    fail with "unknown or expired exchange".
    """
    redis = {name: redis_server_factory() for name in "ab"}
    regions = make_regions(tmp_path, redis, {"a": 2, "b": 2}, anti_entropy_interval="0.5s")
    a, b = regions["a"], regions["b"]
    for region in (a, b):
        await start(region, supervisors)
    for region in (a, b):
        await statuses(http, region, all_ready)
    marks = {r.name: len(r.proc.lines) for r in (a, b) if r.proc is not None}
    first = {r.name: (await statuses(http, r, lambda s: 0 in s))[0] for r in (a, b)}

    async def traffic() -> None:
        for n in range(1_000_000):
            await hit(http, a if n % 2 else b, Counter(), [f"user:{n % 500}"], 1)

    load = asyncio.ensure_future(traffic())
    try:
        for region, peer in ((a, "b"), (b, "a")):
            done: int = first[region.name]["peers"][peer]["anti_entropy_ok"]

            def five_more(s: dict[int, JSON], peer: str = peer, done: int = done) -> bool:
                return 0 in s and s[0]["peers"][peer]["anti_entropy_ok"] >= done + 5

            await statuses(http, region, five_more)
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    for region in (a, b):
        assert region.proc is not None
        later = "\n".join(region.proc.lines[marks[region.name]:])
        assert "anti-entropy with" not in later, later
        assert "unknown or expired exchange" not in later, later
    await stop(a)
    await stop(b)


async def test_a_killed_worker_is_restarted_and_its_outbox_is_delivered(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    redis = {name: redis_server_factory() for name in "ab"}
    regions = make_regions(tmp_path, redis, {"b": 2})
    a, b = regions["a"], regions["b"]
    proc = await start(a, supervisors, "--workers", "2")  # b stays down for now: a's outboxes fill up
    await statuses(http, a, lambda s: len(s) == 2 and all(x["ready"] for x in s.values()))
    hits: Counter[str] = Counter()
    await hit(http, a, hits, [f"user:{i}" for i in range(60)], 3)
    # One outbox entry per key, each in the outbox of the worker owning the key's shard.
    seen = await statuses(http, a, lambda s: len(s) == 2 and sorted(x["peers"]["b"]["outbox"] for x in s.values())[0] > 0
                          and sum(x["peers"]["b"]["outbox"] for x in s.values()) == 60)
    queued = {i: s["peers"]["b"]["outbox"] for i, s in seen.items()}
    victim = seen[1]["worker"]["pid"]

    os.kill(victim, signal.SIGKILL)
    await proc.wait_for_log(rf"worker 1 \(pid {victim}\) was killed by SIGKILL unexpectedly; restarting it in")
    restarted = int((await proc.wait_for_log(r"worker 1 restarted \(pid (\d+)\)")).group(1))
    assert restarted != victim
    assert not alive(victim)
    # The new worker 1 recovered the same outbox from Redis (in-flight batches included).
    await statuses(http, a, lambda s: 1 in s and s[1]["worker"]["pid"] == restarted
                   and s[1]["peers"]["b"]["outbox"] == queued[1])
    await hit(http, a, hits, [f"late:{i}" for i in range(20)], 2)  # both workers serve again

    await start(b, supervisors)
    await statuses(http, b, lambda s: len(s) == 2)
    await converged(http, b, "a", hits)
    await statuses(http, a, lambda s: len(s) == 2 and all(x["peers"]["b"]["outbox"] == 0 for x in s.values()))
    assert proc.proc.returncode is None
    assert "giving up" not in proc.log
    await stop(a)
    await stop(b)

"""Helpers of the `geolimit agent --workers 2` tests (test_workers.py, test_workers_lifecycle.py):
regions a and b, each a real supervisor with two workers on one port, real redis-servers.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import JSON, AgentProcess, dump_toml, region_config, write_secret
from tests.support.regions import eventually

RULE = {"name": "api", "limit": "100000/1h", "resolution": "6m"}

@dataclass
class Region:
    name: str
    url: str
    config: Path
    proc: AgentProcess | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def make_regions(tmp_path: Path, redis: dict[str, EmbeddedRedis], workers_in_toml: dict[str, int],
                 anti_entropy_interval: str = "1h", rules: Sequence[Mapping[str, Any]] = (RULE,),
                 interval: float = 0.05) -> dict[str, Region]:
    """Configs of regions a and b on fixed loopback ports, peers of each other, with a fresh secret.

    Anti-entropy runs at start-up and then every ``anti_entropy_interval`` (by default
    never again in a test: what converges later travelled as deltas, from both workers).
    """
    write_secret(tmp_path / "gossip.key")
    ports = {name: free_port() for name in redis}
    regions = {}
    for name, server in redis.items():
        peers = [{"name": p, "url": f"http://127.0.0.1:{port}"} for p, port in ports.items() if p != name]
        data = region_config(server.url, name=name, listen=f"127.0.0.1:{ports[name]}",
                             secret_file=str(tmp_path / "gossip.key"), peers=peers, rules=rules,
                             interval=interval)
        data["gossip"] |= {"anti_entropy_interval": anti_entropy_interval, "timeout": "2s"}
        if name in workers_in_toml:
            data["region"]["workers"] = workers_in_toml[name]
        path = tmp_path / f"{name}.toml"
        path.write_text(dump_toml(data))
        regions[name] = Region(name, f"http://127.0.0.1:{ports[name]}", path)
    return regions


async def start(region: Region, running: list[AgentProcess], *extra: str) -> AgentProcess:
    region.proc = await AgentProcess.start(region.config, "--flush-timeout", "2", *extra)
    running.append(region.proc)
    return region.proc


async def get(http: aiohttp.ClientSession, url: str, **params: str) -> Any:
    async with http.get(url, params=params) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        return await (resp.json() if resp.content_type == "application/json" else resp.text())


async def statuses(http: aiohttp.ClientSession, region: Region, until: Callable[[dict[int, JSON]], bool],
                   timeout: float = 30.0) -> dict[int, JSON]:
    """/v1/status by worker index, polled (each on a new connection) until ``until`` holds for them."""
    seen: dict[int, JSON] = {}

    async def poll() -> bool:
        try:
            status = await get(http, region.url + "/v1/status")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        seen[status["worker"]["index"]] = status
        return until(seen)

    try:
        await eventually(poll, timeout=timeout, what=f"statuses of {region.name}")
    except AssertionError as exc:
        log = region.proc.log if region.proc else ""
        raise AssertionError(f"{exc}; last seen: {seen}; log:\n{log}") from None
    return seen


def all_ready(seen: dict[int, JSON]) -> bool:
    """Both workers answered ready; worker 0 (the only initiator) completed an anti-entropy run."""
    return len(seen) == 2 and all(s["ready"] for s in seen.values()) and all(
        p["anti_entropy_ok"] >= 1 for p in seen[0]["peers"].values())


async def hit(http: aiohttp.ClientSession, region: Region, hits: Counter[str], subjects: list[str], times: int) -> None:
    """``times`` decisions per subject in ``region``, 16 at a time, counted in ``hits``."""
    sem = asyncio.Semaphore(16)

    async def one(subject: str) -> None:
        async with sem, http.post(region.url + "/v1/check", json={"rule": "api", "subject": subject}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["allowed"]
        hits[subject] += 1

    await asyncio.gather(*(one(s) for s in subjects for _ in range(times)))


async def converged(http: aiohttp.ClientSession, region: Region, origin: str, hits: Counter[str],
                    timeout: float = 30.0) -> None:
    """``region`` counts exactly ``hits[subject]`` hits of ``origin`` for every subject."""
    wrong: dict[str, int] = {}

    async def check() -> bool:
        wrong.clear()
        for subject, count in hits.items():
            usage = await get(http, region.url + "/v1/usage", rule="api", subject=subject)
            if usage["regions"].get(origin, 0) != count:
                wrong[subject] = usage["regions"].get(origin, 0)
        return not wrong

    await eventually(check, timeout=timeout, what=f"{origin}'s hits in {region.name} (wrong: {wrong})")


async def every_worker_reports(http: aiohttp.ClientSession, region: Region, decisions: int) -> None:
    """/metrics scrapes until each worker has answered one with ``decisions`` in geolimit_decisions_total.

    Each scrape merges the answering worker's figures with the other workers'
    snapshots (at most a second old).
    """
    found: dict[int, float] = {}

    async def scrape() -> bool:
        text = await get(http, region.url + "/metrics")
        worker = int(re.search(r'target_info\{worker="(\d+)",workers="2"\} 1\.0', text).group(1))  # type: ignore[union-attr]
        found[worker] = sum(float(v) for v in re.findall(r"^geolimit_decisions_total\{[^}]*\} (\S+)$", text, re.M))
        return found == {0: decisions, 1: decisions}

    await eventually(scrape, timeout=20, what=f"a /metrics answer from each worker counting {decisions} ({found})")


async def stop(region: Region) -> None:
    assert region.proc is not None
    region.proc.proc.send_signal(signal.SIGTERM)
    assert await region.proc.wait(timeout=30) == 0, region.proc.log
    log = region.proc.log
    for index in (0, 1):
        assert f"[worker {index}]: agent {region.name}: stopped" in log, log
    assert "workers stopped (worker 0 exited with code 0, worker 1 exited with code 0)" in log, log

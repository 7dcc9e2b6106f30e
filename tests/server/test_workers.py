"""`geolimit agent --workers 2`: real supervisor and worker processes, two regions, real redis-servers.

Each region runs a supervisor and two workers sharing one port (SO_REUSEPORT).
The test client opens a new connection per request, so the kernel spreads
them over the workers; ``/v1/status`` and ``/metrics`` say which one answered.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geolimit.replication.auth import SEQ
from geolimit.server.workers import Supervisor, WorkerSigner, owned_shards
from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import JSON, AgentProcess, cli, dump_toml, region_config, write_secret
from tests.support.cli_process import any_worker_session, stop_all
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


@pytest.fixture
async def running() -> AsyncIterator[list[AgentProcess]]:
    """Supervisors started by the test: killed at teardown if still running, with their workers."""
    procs: list[AgentProcess] = []
    try:
        yield procs
    finally:
        await stop_all(procs)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request, so requests land on any worker."""
    async with any_worker_session() as s:
        yield s


def make_regions(tmp_path: Path, redis: dict[str, EmbeddedRedis], workers_in_toml: dict[str, int],
                 anti_entropy_interval: str = "1h") -> dict[str, Region]:
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
                             secret_file=str(tmp_path / "gossip.key"), peers=peers, rules=[RULE])
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


async def test_two_workers_share_the_port_serve_decisions_replicate_exactly_and_reload(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    redis = {name: redis_server_factory() for name in "ab"}
    regions = make_regions(tmp_path, redis, {"a": 2})  # a: workers in the TOML; b: on the command line
    a, b = regions["a"], regions["b"]
    await start(a, running)
    await start(b, running, "--workers", "2")
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
    assert not gone, f"workers still running after their supervisor stopped: {gone}"


async def test_anti_entropy_exchanges_stay_on_the_worker_that_began_them(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess],
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
        await start(region, running)
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
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    redis = {name: redis_server_factory() for name in "ab"}
    regions = make_regions(tmp_path, redis, {"b": 2})
    a, b = regions["a"], regions["b"]
    proc = await start(a, running, "--workers", "2")  # b stays down for now: a's outboxes fill up
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

    await start(b, running)
    await statuses(http, b, lambda s: len(s) == 2)
    await converged(http, b, "a", hits)
    await statuses(http, a, lambda s: len(s) == 2 and all(x["peers"]["b"]["outbox"] == 0 for x in s.values()))
    assert proc.proc.returncode is None
    assert "giving up" not in proc.log
    await stop(a)
    await stop(b)


async def test_workers_stop_when_their_supervisor_is_killed(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    regions = make_regions(tmp_path, {"a": redis_server_factory()}, {"a": 2})
    proc = await start(regions["a"], running)
    seen = await statuses(http, regions["a"], lambda s: len(s) == 2)
    pids = [s["worker"]["pid"] for s in seen.values()]
    proc.proc.send_signal(signal.SIGKILL)
    await eventually(lambda: not any(alive(pid) for pid in pids), timeout=20,
                     what=f"orphaned workers {pids} to stop; log:\n{proc.log}")
    await proc.wait_for_log(r"\[worker [01]\]: the supervisor \(pid \d+\) is gone: this worker stops")


@pytest.mark.parametrize("held", ["region.listen", "region.api_listen"])
async def test_a_port_held_by_another_process_fails_the_supervisor_at_once(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], running: list[AgentProcess], held: str,
) -> None:
    """Once, workers that could not bind crash-looped ~14 s; now the supervisor binds the ports first: one
    error line, exit 1, no worker started (the crash-loop give-up: the stand-in worker test below)."""
    regions = make_regions(tmp_path, {"a": redis_server_factory()}, {"a": 2})
    with socket.socket() as squatter:  # holds the port without SO_REUSEPORT: no worker could bind it
        squatter.bind(("127.0.0.1", 0 if held == "region.api_listen" else int(regions["a"].url.rpartition(":")[2])))
        squatter.listen()
        port = int(squatter.getsockname()[1])
        if held == "region.api_listen":  # the [region] table comes first
            config = regions["a"].config
            config.write_text(config.read_text().replace("[gossip]", f'api_listen = "127.0.0.1:{port}"\n[gossip]', 1))
        proc = await start(regions["a"], running)
        assert await proc.wait(timeout=10) == 1  # Python's start-up and the config: ~0.5 s
    assert proc.lines == [f"geolimit: error: agent a: cannot listen on {held} 127.0.0.1:{port}: "
                          "[Errno 98] Address already in use"], proc.log


@pytest.mark.parametrize(("workers", "port", "args", "expected"), [
    pytest.param(0, 7400, (), "region.workers must be an integer from 1 to 64, got 0", id="toml-zero"),
    pytest.param("2", 7400, (), "region.workers must be an integer from 1 to 64, got '2'", id="toml-string"),
    pytest.param(2, 0, (), "region.workers = 2 needs a fixed port in region.listen", id="port-0"),
])
async def test_bad_workers_values_are_config_errors(
    tmp_path: Path, workers: object, port: int, args: tuple[str, ...], expected: str
) -> None:
    """Refused before anything starts (nothing listens on the port or connects to Redis)."""
    write_secret(tmp_path / "gossip.key")
    data = region_config("redis://127.0.0.1:1/0", listen=f"127.0.0.1:{port}", rules=[RULE])
    if workers is not None:
        data["region"]["workers"] = workers
    (tmp_path / "a.toml").write_text(dump_toml(data))
    ran = await cli("agent", "--config", str(tmp_path / "a.toml"), *args)
    assert ran.code == 1, ran
    assert expected in ran.stderr, ran.stderr
    assert ran.stderr.startswith("geolimit: error: "), ran.stderr


def test_workers_own_every_shard_exactly_once() -> None:
    for shards, workers in ((64, 1), (64, 2), (64, 3), (64, 64), (16, 5)):
        owned = [owned_shards(shards, i, workers) for i in range(workers)]
        assert sorted(s for part in owned for s in part) == list(range(shards))
        assert max(map(len, owned)) - min(map(len, owned)) <= 1
    assert owned_shards(8, 1, 2) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="worker index 2"):
        owned_shards(8, 2, 2)


def test_worker_signers_never_pick_the_same_sequence_number() -> None:
    """Two workers of a region sign as the region: the peers' replay guard must see distinct seqs."""
    now = [1_700_000_000.0]
    signers = [WorkerSigner(b"k" * 32, "a", lambda: now[0], index=i, workers=3) for i in range(3)]
    seen: list[int] = []
    for step in range(200):
        now[0] += 0.0000005 * (step % 3)  # often the same microsecond for every worker
        for i, signer in enumerate(signers):
            seq = int(signer.headers(b"body", "b")[SEQ])
            assert seq % 3 == i
            seen.append(seq)
    assert len(set(seen)) == len(seen)
    for i in range(3):
        mine = seen[i::3]
        assert mine == sorted(mine)
        assert mine[0] >= 1_700_000_000 * 1_000_000


STAND_IN = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[sys.argv.index("--config") + 1]).with_suffix("." + sys.argv[sys.argv.index("--worker-index") + 1])
if out.exists():
    sys.exit(3)  # the second start of this worker crashes, and so does every later one
out.write_text("started\\n")
signal.signal(signal.SIGHUP, lambda *_: out.write_text(out.read_text() + "reload\\n"))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


async def test_supervisor_object_forwards_signals_and_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    """The Supervisor with a stand-in worker program (the real agent is tested above): its contract, fast."""
    config = tmp_path / "x.toml"
    sup = Supervisor(config, 2, region="x", first_backoff=0.05, max_crashes=3, crash_window=60.0,
                     command=[sys.executable, "-c", STAND_IN])
    async with sup:
        await eventually(lambda: all((tmp_path / f"x.{i}").exists() for i in range(2)), timeout=20, what="workers")
        sup.reload()
        await eventually(lambda: all("reload" in (tmp_path / f"x.{i}").read_text() for i in range(2)),
                         timeout=20, what="SIGHUP forwarded")
        first = sup.pids
        os.kill(first[1], signal.SIGKILL)  # restarted, then crashes twice more: the supervisor gives up
        assert await asyncio.wait_for(sup.wait(), 20) == 1
        assert sup.failure == "worker 1 exited with code 3; it crashed 3 times within 60s"
        assert sup.restarts == [0, 2]
    assert not alive(first[0])

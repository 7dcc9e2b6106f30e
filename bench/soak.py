"""Soak: 3 regions on loopback, 1M live subjects, load as fast as the machine allows.

    python bench/soak.py [--minutes 10] [--subjects 1000000] [--quick] [--json PATH]

Each region has its own redis-server and its own `geolimit agent` process (default
settings, a fresh secret). One load process per region calls ``AsyncLimiter.hit_many``
on its region's Redis (what apps do; agents only replicate), on subjects drawn
uniformly from ``--subjects``, for ``--minutes``. The rule's window covers the run,
so every subject stays live and its usage must equal every hit the load recorded.
Printed: decisions/s against a same-run baseline (the same load processes on the
same redis-servers with no agent: no replication, half before the soak, half after);
every 10 s each agent's RSS, the largest outbox and outbox age; the gossip lag (the
agents' outbox age every second, and a probe hit every second timed until both
other regions count it); CPU per decision; the time after the stop until a sample
(2000 random subjects plus those last hit) is exact in every region; PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import shutil
import signal
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio
from _agents import (
    AgentProcess,
    LoadResult,
    LoadSpec,
    LoadWatch,
    agent_json,
    agent_toml_rule,
    cell_totals_at,
    failures,
    log_problems,
    proc_cpu_seconds,
    read_usages,
    redis_cpu_seconds,
    rss_mib,
    run_load,
    soak_subject,
    start_agent_processes,
    statuses,
    stop_process,
    wait_agents_ready,
)
from _common import busy_seconds, source_state
from _soak_report import (
    CONVERGE_WAIT,
    PROBE_EVERY,
    REGIONS,
    ROW_EVERY,
    STATUS_EVERY,
    Samples,
    report,
    summarize_run,
)

from geolimit import AsyncLimiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.errors import GeolimitError
from geolimit.store.embedded import EmbeddedRedis, find_redis_server

LAYOUT = KeyLayout("gl", 64)
SAMPLE = 2000  # random subjects checked after the stop, besides those each load process hit last
Progress = Any  # a multiprocessing Array('q'): decisions and errors of each load process


def soak_rule(minutes: float) -> Rule:
    """1-minute buckets and a window longer than the run plus 3 minutes: nothing expires."""
    return Rule("soak", 10**9, 60 * math.ceil((minutes * 60 + 180) / 60), 60)


# -- sampling while the soak runs ---------------------------------------------------------


async def cpu_now(clients: dict[str, redis.asyncio.Redis], agents: list[AgentProcess]) -> dict[str, float]:
    """CPU seconds so far: every redis-server and agent, this process, the whole machine."""
    out = {f"redis {r}": await redis_cpu_seconds(c) for r, c in clients.items()}
    out |= {"bench": time.process_time(), "machine": busy_seconds(), "wall": time.monotonic()}
    return out | {f"agent {a.region}": proc_cpu_seconds(a.proc.pid) or math.nan for a in agents}


async def sample(agents: list[AgentProcess], clients: dict[str, redis.asyncio.Redis], progress: Progress,
                 t0: float, stop_at: float, out: Samples) -> None:
    """Every agent's /v1/status every second; a table row every ROW_EVERY seconds (until cancelled)."""
    last_row, last_total = t0, 0
    print(f"{'t s':>5} {'phase':5} {'dec/s':>7} {'errs':>4} " + " ".join(f"{'RSS ' + a.region:>13}" for a in agents)
          + f" {'outbox max':>10} {'lag max':>7} {'keys/region':>11}")
    async with aiohttp.ClientSession() as http:
        while True:
            await asyncio.sleep(STATUS_EVERY - (time.monotonic() - t0) % STATUS_EVERY)
            now, links = time.monotonic(), dict[str, dict[str, float]]()
            for a in agents:
                try:
                    st = await agent_json(http, a.url + "/v1/status")
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    out.status_errors += 1
                    continue
                links |= {f"{a.region}>{peer}": {"outbox": p["outbox"], "lag": p["lag"]} for peer, p in st["peers"].items()}
            out.status.append({"t": now - t0, "load": now < stop_at, "links": links})
            if now - last_row < ROW_EVERY - 0.5:
                continue
            total = sum(progress[0::2])
            row = {"t": now - t0, "phase": "load" if now < stop_at else "after",
                   "decisions_per_s": (total - last_total) / (now - last_row), "errors": sum(progress[1::2]),
                   "rss_mib": {a.region: rss_mib(a.proc.pid) for a in agents},
                   "outbox_max": max((v["outbox"] for v in links.values()), default=0),
                   "lag_max": max((v["lag"] for v in links.values()), default=0.0),
                   "keys": int(await clients[REGIONS[0]].dbsize())}
            last_row, last_total = now, total
            out.rows.append(row)
            rss = " ".join(f"{'-' if v is None else f'{v:.0f} MiB':>13}" for v in row["rss_mib"].values())
            print(f"{row['t']:5.0f} {row['phase']:5} {row['decisions_per_s']:7.0f} {row['errors']:4} {rss} "
                  f"{row['outbox_max']:10} {row['lag_max']:6.2f}s {row['keys']:11}", flush=True)


async def probe(limiters: dict[str, AsyncLimiter], rule: Rule, stop_at: float, out: Samples) -> None:
    """Every second a hit in one region (rotating); the time until both others count it."""
    async def one(i: int, region: str) -> None:
        name, others = b"probe:%d" % i, [r for r in limiters if r != region]
        try:
            await limiters[region].hit(rule.name, name)
            sent = time.monotonic()
            while time.monotonic() - sent < CONVERGE_WAIT:
                if all(u.total == 1 for u in [await limiters[r].usage(rule.name, name) for r in others]):
                    out.probes.append(time.monotonic() - sent)
                    return
                await asyncio.sleep(0.01)
        except GeolimitError:
            pass
        out.probes_lost += 1

    tasks = []
    try:
        for i, region in zip(itertools.count(), itertools.cycle(limiters)):
            if time.monotonic() >= stop_at:
                break
            tasks.append(asyncio.ensure_future(one(i, region)))
            await asyncio.sleep(PROBE_EVERY)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- convergence after the stop ------------------------------------------------------------


class Sweeps:
    """Sweeps of a sample of subjects: every region's cell totals, all chunks of 1000 read
    at once, each stamped with when its Redis read it (the state was exactly that then:
    a reply that waits behind the agents' flush does not count as convergence time).

    Sweeping starts as soon as the load processes have made their last decisions, before
    their counts are in (sending them takes a while); the sweeps read so far are judged
    once the counts are known (``judge``)."""

    def __init__(self, clients: dict[str, redis.asyncio.Redis], rule: Rule, ids: set[int], t_stop: float) -> None:
        self.clients, self.rule, self.t_stop = clients, rule, t_stop
        self.sample = frozenset(ids)
        self.pending = set(ids)  # not yet read exact
        self.unjudged: list[tuple[list[int], list[list[int | None]], list[list[float]]]] = []
        self.began: float | None = None  # seconds after the stop of the first read
        self.log: list[dict[str, Any]] = []
        self.first_exact = self.last_inexact = 0.0

    async def sweep(self) -> None:
        # One sweep reads every chunk of every region at once: a sweep then takes one
        # round of the servers' work, not one client round trip per chunk in turn
        # (read one after another, 16 chunks took 2.9 s with nothing ever inexact).
        ids = sorted(self.pending)
        if self.began is None:
            self.began = time.monotonic() - self.t_stop
        keys = [LAYOUT.data_key(self.rule.name, soak_subject(i)) for i in ids]
        chunks = [keys[lo:lo + 1000] for lo in range(0, len(keys), 1000)]
        replies = await asyncio.gather(*(cell_totals_at(self.clients[r], c) for r in REGIONS for c in chunks))
        wall_to_mono = time.monotonic() - time.time()
        views = [[t for part, _ in replies[k * len(chunks):(k + 1) * len(chunks)] for t in part]
                 for k in range(len(REGIONS))]
        read_at = [[max(0.0, at + wall_to_mono - self.t_stop) for _, at in replies[k * len(chunks):(k + 1) * len(chunks)]]
                   for k in range(len(REGIONS))]
        self.unjudged.append((ids, views, read_at))

    def judge(self, exact: Callable[[int, list[int | None]], bool]) -> None:
        """Judge the sweeps read so far, in order: a subject leaves the sample once it was
        read exact in every region; the convergence time is the latest first exact read."""
        for ids, views, read_at in self.unjudged:
            for j, i in enumerate(ids):
                if i not in self.pending:
                    continue
                at = max(row[j // 1000] for row in read_at)  # the latest of the regions' reads of it
                if exact(i, [v[j] for v in views]):
                    self.first_exact = max(self.first_exact, at)
                    self.pending.discard(i)
                else:
                    self.last_inexact = max(self.last_inexact, at)
            self.log.append({"at": max(max(row) for row in read_at), "inexact": len(self.pending)})
        self.unjudged = []


def sample_ids(n: int) -> set[int]:
    """The random part of the sample (the subjects hit last are added to it)."""
    return set(random.Random(7).sample(range(n), min(SAMPLE, n)))


async def converge(clients: dict[str, redis.asyncio.Redis], rule: Rule, results: list[LoadResult],
                   n: int, t_stop: float, early: Sweeps | None) -> dict[str, Any]:
    """Judge the sweeps that ``early`` read from the stop on, then sweep until each subject is
    exact; then check it all once more through the limiter's usage reading, by region. A
    region's view of a slot never exceeds the truth, so an exact total means every slot is
    exact. A subject hit by a call that failed (a client timeout: Redis may still have run
    it) is exact when every region reads the same total within the recorded hits plus
    those uncertain ones."""
    counts = {r.region: array("I", r.counts) for r in results}
    unsure = {r.region: array("I", r.uncertain) for r in results}
    chosen = sample_ids(n)
    tail = set().union(*(r.tail for r in results)) - chosen
    ids = sorted(chosen | tail)
    want = {i: sum(int(c[i]) for c in counts.values()) for i in ids}
    slack = {i: sum(int(c[i]) for c in unsure.values()) for i in ids}

    def exact(i: int, totals: list[int | None]) -> bool:
        first = totals[0]
        return first is not None and len(set(totals)) == 1 and want[i] <= first <= want[i] + slack[i]

    sweeps = early if early is not None and early.sample == set(ids) else Sweeps(clients, rule, set(ids), t_stop)
    sweeps.judge(exact)
    while sweeps.pending and time.monotonic() - t_stop < CONVERGE_WAIT:
        await sweeps.sweep()
        sweeps.judge(exact)
    usages = await asyncio.gather(*(read_usages(clients[r], LAYOUT, rule, [soak_subject(i) for i in ids]) for r in REGIONS))
    wrong = []
    for j, i in enumerate(ids):
        expected = {r: int(c[i]) for r, c in counts.items() if c[i]}
        seen = [{k: v for k, v in u[j].by_region.items() if v} for u in usages]
        sure = not slack[i] and all(s == expected for s in seen)
        unsure_ok = bool(slack[i]) and all(s == seen[0] for s in seen) and all(
            expected.get(r, 0) <= seen[0].get(r, 0) <= expected.get(r, 0) + int(unsure[r][i]) for r in counts)
        if not (sure or unsure_ok):
            wrong.append({"subject": soak_subject(i).decode(), "expected": expected,
                          "seen": {r: u[j].by_region for r, u in zip(REGIONS, usages, strict=True)}})
    return {"sampled": len(ids), "random": len(chosen), "tail": len(tail), "exact": len(ids) - len(wrong),
            "uncertain": sum(1 for i in ids if slack[i]),
            "checked_at": time.monotonic() - t_stop, "converged_s": None if sweeps.pending else sweeps.first_exact,
            "last_inexact_s": sweeps.last_inexact, "sweeps": sweeps.log, "reads_began_s": sweeps.began,
            "first_inexact": wrong[0] if wrong else None}


# -- the run ------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    if task is not None:  # SIGTERM (and SIGINT, unless ignored) unwind the exit stack: every process stops
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                loop.add_signal_handler(sig, task.cancel)
    rule, n, seconds, half = soak_rule(args.minutes), args.subjects, args.minutes * 60, args.baseline_seconds / 2
    spec = LoadSpec(rule, n)
    result: dict[str, Any] = {"minutes": args.minutes, "subjects": n, "rule": rule.describe(),
                              "source": source_state(), "baseline_seconds": args.baseline_seconds}
    async with AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="geolimit-soak-")))
        servers = {r: stack.enter_context(EmbeddedRedis()) for r in REGIONS}
        urls = {r: s.url for r, s in servers.items()}
        clients = {r: redis.asyncio.Redis.from_url(u) for r, u in urls.items()}
        for c in clients.values():
            stack.push_async_callback(c.aclose)
        result["redis"] = f"{servers[REGIONS[0]].version} ({find_redis_server()})"
        print(f"soak: {len(REGIONS)} regions, {n} subjects, {args.minutes:g} min, rule {rule.describe()}, "
              f"redis {result['redis']}\nbaseline (no agents): {half:g} s ...", flush=True)

        async def baseline() -> dict[str, Any]:
            await asyncio.gather(*(c.flushall() for c in clients.values()))
            before = await cpu_now(clients, [])
            base = await run_load(urls, spec, half)
            return {"results": base, "cpu": diff(await cpu_now(clients, []), before)}

        base_before = await baseline()
        await asyncio.gather(*(c.flushall() for c in clients.values()))
        agents = start_agent_processes(folder, urls, agent_toml_rule(rule))

        def stop_agents() -> None:
            for a in agents:
                stop_process(a.proc)

        stack.callback(stop_agents)
        await wait_agents_ready(agents)
        limiters = {r: AsyncLimiter.from_url(u, region=r, rules=[rule]) for r, u in urls.items()}
        for lim in limiters.values():
            stack.push_async_callback(lim.aclose)
        samples = Samples()
        sampler: list[asyncio.Future[None]] = []
        early: list[Sweeps] = []
        sweeping: list[asyncio.Future[None]] = []
        results_in = asyncio.Event()

        async def sweep_from_the_stop(watch: LoadWatch) -> None:
            t_last, tail = await watch.stopped()
            sweeps = Sweeps(clients, rule, sample_ids(n) | set(tail), t_last)
            early.append(sweeps)
            while not results_in.is_set():
                await sweeps.sweep()

        async def alongside(watch: LoadWatch) -> None:
            await asyncio.sleep(max(0.0, watch.start_at - time.monotonic()))
            samples.cpu_start = await cpu_now(clients, agents)
            samples.failures_start = failures(await statuses(agents))
            sampler.append(asyncio.ensure_future(
                sample(agents, clients, watch.progress, watch.start_at, watch.start_at + seconds, samples)))
            sweeping.append(asyncio.ensure_future(sweep_from_the_stop(watch)))
            await probe(limiters, rule, watch.start_at + seconds, samples)

        print(f"soak: {seconds:g} s of load ...", flush=True)
        results = await run_load(urls, spec, seconds, alongside)
        results_in.set()
        await asyncio.gather(*sweeping, return_exceptions=True)  # the sweep in progress ends
        cpu = diff(await cpu_now(clients, agents), samples.cpu_start)
        t_stop, t_start = max(r.last for r in results), min(r.first for r in results)
        conv = await converge(clients, rule, results, n, t_stop, early[0] if early else None)
        await asyncio.sleep(2 * STATUS_EVERY)  # a status sample or two after convergence
        for watcher in sampler:
            watcher.cancel()
        await asyncio.gather(*sampler, return_exceptions=True)
        final = await statuses(agents)
        exits = {a.region: stop_process(a.proc) for a in agents}
        logs = {a.region: log_problems(a.log) for a in agents}
        for a in agents if args.json else []:  # keep the agents' logs next to the figures
            shutil.copy(a.log, f"{args.json}.{a.region}.log")
        print(f"baseline (no agents): {half:g} s ...", flush=True)
        base_after = await baseline()
    result.update(summarize_run(results, [base_before, base_after], samples, conv, final, exits, logs,
                                cpu, t_stop - t_start, seconds))
    return result


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, math.nan) for k, v in after.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    parser.add_argument("--subjects", type=int, default=1_000_000, help="distinct subjects (default 1M)")
    parser.add_argument("--quick", action="store_true", help="1 minute, 100k subjects, 20 s of baseline")
    parser.add_argument("--baseline-seconds", type=float, help="no-agent baseline, half before and half after (default 60)")
    parser.add_argument("--json", help="write every figure as JSON here (and the agents' logs as PATH.REGION.log)")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.subjects = 1.0, 100_000
    args.baseline_seconds = args.baseline_seconds or (20.0 if args.quick else 60.0)
    try:
        result = asyncio.run(soak(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every process was stopped", file=sys.stderr)
        return 130
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

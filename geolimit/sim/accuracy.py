"""The accuracy harness behind ``geolimit bench accuracy``.

The standard scenario: 3 regions, 50 ms one-way latency, gossip every 100 ms,
a limit of 1000 per 10 s in 1 s buckets, offered load 3x the limit spread
uniformly over the regions as Poisson arrivals, 60 s. Variants skew the load,
send it in bursts, cut one region off for 20 s, or skew the regions' clocks by
±1 s. Three more fire 3x a limit at all regions at once, faster than gossip
(OTP 5/60s, login 100/60s) or paced 50 ms apart (10/60s), and one hands the
traffic off from one region to another (600 then 400 of 1000/60s).

Every run is compared with an exact global oracle (``geolimit.sim.oracle``) and,
in the same run, with three baselines: *exact* (one global exact sliding-window
limiter that sees every request at once: the ideal), *no replication* (each
region enforces the full limit alone) and *static split* (each region enforces
limit/3 alone). The
*geolimit* variant is the default (gossip) mode through the real Lua and the
real gossip engine; the *escrow* variant is escrow mode
(:mod:`geolimit.core.escrow`) run by :class:`~geolimit.sim.escrow.EscrowCluster`
over the same simulated links. All in virtual time: the same figures on every run.

A run shorter than its scenario's :attr:`Scenario.min_duration` (the partition
and several windows after it) is marked insufficient: its figures say nothing
about the targets.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from geolimit.core.rule import Mode, Partition, Rule
from geolimit.sim.cluster import SimCluster
from geolimit.sim.escrow import EscrowCluster
from geolimit.sim.oracle import Accuracy, Request, measure

__all__ = ["SCENARIOS", "VARIANTS", "Outcome", "Scenario", "run_scenario", "run_suite"]

Pattern = Literal["poisson", "bursts", "split-burst", "paced-burst", "handoff"]
VARIANTS = ("geolimit", "escrow", "exact", "no replication", "static split")

SUBJECT = b"user:42"


@dataclass(frozen=True)
class Scenario:
    name: str
    regions: int = 3
    latency: float = 0.05
    interval: float = 0.1
    limit: int = 1000
    window: float = 10.0
    resolution: float = 1.0
    load: float = 3.0  # offered load as a multiple of the limit
    weights: tuple[float, ...] | None = None  # share of traffic per region (None: uniform)
    duration: float = 60.0
    pattern: Pattern = "poisson"
    partition: tuple[float, float] | None = None  # (start, length) during which the last region is cut off
    skew: tuple[float, ...] | None = None  # clock offset per region (seconds)
    mode: Mode = "approximate"
    predict: bool = True
    policy: Partition = "local"
    seed: int = 7
    escrow_steps: int = 4  # escrow mode's own steps per bucket (geolimit.core.escrow.Ledger)

    @property
    def min_duration(self) -> float:
        """The shortest run whose figures mean something: for steady traffic three windows,
        and two whole windows after a partition heals; for one-off traffic, one window past its end."""
        if self.pattern in ("poisson", "bursts"):
            healed = 0.0 if self.partition is None else self.partition[0] + self.partition[1]
            return max(3 * self.window, healed + 2 * self.window)
        last = max((t for t, _ in arrivals(self)), default=0.0)
        return float(math.ceil(last + self.window))

    def rule(self, limit: int | None = None) -> Rule:
        return Rule(
            "api", self.limit if limit is None else limit, self.window, self.resolution, self.mode,
            predict=self.predict, partition=self.policy, partition_after=max(1.0, 10 * self.interval),
        )

    @property
    def names(self) -> list[str]:
        return [f"r{i + 1}" for i in range(self.regions)]


SCENARIOS: dict[str, Scenario] = {
    "standard": Scenario("standard"),
    "standard-strict": Scenario("standard-strict", mode="strict"),
    "skewed": Scenario("skewed", weights=(0.9, 0.05, 0.05)),
    "bursts": Scenario("bursts", pattern="bursts"),
    "partition-local": Scenario("partition-local", partition=(20.0, 20.0)),
    "partition-share": Scenario("partition-share", partition=(20.0, 20.0), policy="share"),
    "partition-closed": Scenario("partition-closed", partition=(20.0, 20.0), policy="closed"),
    "clock-skew": Scenario("clock-skew", skew=(0.0, 1.0, -1.0)),
    "burst-otp": Scenario("burst-otp", limit=5, window=60.0, resolution=6.0, pattern="split-burst", duration=62.0),
    "burst-login": Scenario("burst-login", limit=100, window=60.0, resolution=6.0, pattern="split-burst",
                            duration=62.0),
    "burst-paced": Scenario("burst-paced", limit=10, window=60.0, resolution=6.0, pattern="paced-burst",
                            duration=63.0),
    "handoff": Scenario("handoff", limit=1000, window=60.0, resolution=6.0, load=1.0, pattern="handoff",
                        duration=72.0),
}
#: When the one-off patterns begin (seconds after the start).
BURST_AT = 1.0


@dataclass
class Outcome:
    scenario: Scenario
    variant: str  # one of VARIANTS
    accuracy: Accuracy
    convergence: float | None = None  # seconds from heal to identical views
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def insufficient(self) -> str | None:
        """Why this run's figures say nothing about the targets, or None."""
        need = self.scenario.min_duration
        if self.scenario.duration < need:
            s = self.scenario
            why = ("its partition and two windows after it heals" if s.partition is not None
                   else "three windows" if s.pattern in ("poisson", "bursts") else "its traffic and one window after it")
            return f"{s.duration:g} s is shorter than the {need:g} s {s.name} needs ({why})"
        late = self.extra.get("late_p99_ms")  # real-time runs (bench/agents.py): how late requests left
        if late is not None and late > self.scenario.interval * 1000:
            return (f"{self.scenario.name}: the load generator fell behind its schedule (sends late by p99 "
                    f"{late:g} ms, more than the {self.scenario.interval * 1000:g} ms gossip interval), so the "
                    "arrivals were not the scenario's (a stalled machine?); run it again")
        return None


def arrivals(s: Scenario) -> list[tuple[float, str]]:
    """(time offset, region) of every request."""
    if s.pattern == "split-burst":  # load x limit at once, split over the regions, 1 ms apart in each
        per = round(s.load * s.limit / s.regions)
        return sorted((BURST_AT + k * 0.001, name) for k in range(per) for name in s.names)
    if s.pattern == "paced-burst":  # load x limit, round robin over the regions, 50 ms apart
        total = round(s.load * s.limit)
        return [(BURST_AT + k * 0.05, s.names[k % s.regions]) for k in range(total)]
    if s.pattern == "handoff":  # 60% of load x limit in the first region at 100/s, then 40% in the second
        total = round(s.load * s.limit)
        first = total * 6 // 10
        return [(BURST_AT + k * 0.01, s.names[0] if k < first else s.names[1]) for k in range(total)]
    rng = random.Random(s.seed)
    rate = s.load * s.limit / s.window
    weights = list(s.weights or [1.0] * s.regions)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        # bursts: 1 s at 4x the average rate, then 3 s at 2/3 of it (the same mean)
        local = rate * (4.0 if t % 4.0 < 1.0 else 2.0 / 3.0) if s.pattern == "bursts" else rate
        t += rng.expovariate(local)
        if t >= s.duration:
            return out
        out.append((t, rng.choices(s.names, weights)[0]))


async def run_scenario(redis_url: str, s: Scenario, variant: str = "geolimit") -> Outcome:
    if variant == "escrow":
        return await run_escrow_scenario(s)
    if variant == "exact":
        return run_exact_scenario(s)
    replicate = variant == "geolimit"
    rule = s.rule(s.limit // s.regions if variant == "static split" else None)
    skew = dict(zip(s.names, s.skew, strict=True)) if s.skew else None
    async with SimCluster(
        redis_url, s.names, [rule], interval=s.interval, latency=s.latency, skew=skew,
        replicate=replicate, seed=s.seed,
    ) as sim:
        await sim.advance(2 * s.interval)  # agents exchange their first heartbeats
        start_us = sim.clock.now_us()
        log: list[Request] = []
        cut = s.names[-1]
        healed_at: float | None = None
        convergence: float | None = None

        async def decide(region: str) -> None:
            d = await sim.hit(region, "api", SUBJECT)
            log.append(Request(sim.clock.now_us(), region, 1, d.allowed))

        for offset, region in arrivals(s):
            sim.scheduler.at(start_us + round(offset * 1e6), lambda region=region: decide(region))  # type: ignore[misc]
        if s.partition is not None:
            begin, length = s.partition

            async def isolate() -> None:
                sim.network.isolate(cut)

            async def rejoin() -> None:
                nonlocal healed_at
                sim.network.rejoin(cut)
                healed_at = sim.now
                if replicate:
                    sim.scheduler.at(sim.clock.now_us() + 10_000, check)

            async def check() -> None:
                nonlocal convergence
                assert healed_at is not None
                if await _agree_before(sim, healed_at, rule.resolution_us):
                    convergence = sim.now - healed_at
                elif sim.now - healed_at < 10.0:
                    sim.scheduler.at(sim.clock.now_us() + 10_000, check)

            sim.scheduler.at(start_us + round(begin * 1e6), isolate)
            sim.scheduler.at(start_us + round((begin + length) * 1e6), rejoin)
        await sim.run_until(start_us / 1e6 + s.duration)
        end_us = start_us + round(s.duration * 1e6)
    accuracy = measure(log, s.limit, round(s.window * 1e6), start_us, end_us)
    return Outcome(s, variant, accuracy, convergence)


async def _agree_before(sim: SimCluster, healed_at: float, resolution_us: int) -> bool:
    """Do all regions hold the same cells for every bucket completed before the heal?"""
    cutoff = round(healed_at * 1e6) // resolution_us
    states = []
    for name in sim.names:
        cells = await sim.cells(name)
        states.append({k: sorted(c for c in v if c[0] < cutoff) for k, v in cells.items()})
    return all(state == states[0] for state in states[1:])


def run_exact_scenario(s: Scenario) -> Outcome:
    """The ideal: one limiter that sees every request the instant it happens and admits it
    if the true window ``[t - W, t]`` still has room (the oracle's own definition)."""
    start_us = 1_700_000_000_000_000
    window_us = round(s.window * 1e6)
    admitted: deque[int] = deque()
    log: list[Request] = []
    for offset, region in arrivals(s):
        now = start_us + round(offset * 1e6)
        while admitted and admitted[0] < now - window_us:
            admitted.popleft()
        allowed = len(admitted) + 1 <= s.limit
        if allowed:
            admitted.append(now)
        log.append(Request(now, region, 1, allowed))
    accuracy = measure(log, s.limit, window_us, start_us, start_us + round(s.duration * 1e6))
    return Outcome(s, "exact", accuracy)


async def run_escrow_scenario(s: Scenario) -> Outcome:
    """The scenario in escrow mode: the same arrivals, links and partition, no Redis."""
    skew = dict(zip(s.names, s.skew, strict=True)) if s.skew else None
    sim = EscrowCluster(
        s.names, s.limit, s.window, s.resolution, interval=s.interval, latency=s.latency, skew=skew, seed=s.seed,
        steps=s.escrow_steps,
    )
    sim.start()
    await sim.advance(2 * s.interval)
    start_us = sim.clock.now_us()
    log: list[Request] = []
    healed_at: float | None = None
    convergence: float | None = None

    async def decide(region: str) -> None:
        d = sim.hit(region, SUBJECT)
        log.append(Request(sim.clock.now_us(), region, 1, d.allowed))

    async def isolate() -> None:
        sim.network.isolate(s.names[-1])

    async def rejoin() -> None:
        nonlocal healed_at
        sim.network.rejoin(s.names[-1])
        healed_at = sim.now
        sim.scheduler.at(sim.clock.now_us() + 10_000, check)

    async def check() -> None:
        nonlocal convergence
        assert healed_at is not None
        if sim.agree():
            convergence = sim.now - healed_at
        elif sim.now - healed_at < 10.0:
            sim.scheduler.at(sim.clock.now_us() + 10_000, check)

    for offset, region in arrivals(s):
        sim.scheduler.at(start_us + round(offset * 1e6), lambda region=region: decide(region))  # type: ignore[misc]
    if s.partition is not None:
        begin, length = s.partition
        sim.scheduler.at(start_us + round(begin * 1e6), isolate)
        sim.scheduler.at(start_us + round((begin + length) * 1e6), rejoin)
    await sim.run_until(start_us / 1e6 + s.duration)
    end_us = start_us + round(s.duration * 1e6)
    accuracy = measure(log, s.limit, round(s.window * 1e6), start_us, end_us)
    given = sum(r.given for r in sim.regions.values())
    return Outcome(s, "escrow", accuracy, convergence, {"rights_given": given})


#: Called after every run: (outcome, runs done, runs in all, wall seconds the run took).
Progress = Callable[[Outcome, int, int, float], None]


async def run_suite(
    redis_url: str, names: Sequence[str], duration: float | None = None,
    variants: Sequence[str] = VARIANTS, progress: Progress | None = None, seed: int | None = None,
) -> list[Outcome]:
    """Every scenario in every variant. ``duration`` overrides the scenarios' own; partitions
    keep their times (a run shorter than a scenario's ``min_duration`` is marked insufficient).
    ``seed`` overrides the scenarios' seed of the random arrivals."""
    outcomes: list[Outcome] = []
    total = len(names) * len(variants)
    for name in names:
        scenario = SCENARIOS[name]
        if duration is not None:
            scenario = replace(scenario, duration=duration)
        if seed is not None:
            scenario = replace(scenario, seed=seed)
        for variant in variants:
            began = time.perf_counter()
            outcome = await run_scenario(redis_url, scenario, variant)
            outcomes.append(outcome)
            if progress is not None:
                progress(outcome, len(outcomes), total, time.perf_counter() - began)
    return outcomes

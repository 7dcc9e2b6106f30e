"""The accuracy harness behind ``geolimit bench accuracy``.

The standard scenario: 3 regions, 50 ms one-way latency, gossip every 100 ms,
a limit of 1000 per 10 s in 1 s buckets, offered load 3x the limit spread
uniformly over the regions as Poisson arrivals, 60 s. Variants skew the load,
send it in bursts, cut one region off for 20 s, or skew the regions' clocks by
±1 s. Every run is compared with an exact global oracle (``geolimit.sim.oracle``)
and, in the same run, with two baselines: *no replication* (each region enforces
the full limit alone) and *static split* (each region enforces limit/3 alone).

Runs in virtual time through the real Lua and the real gossip engine, so a 60 s
scenario takes seconds and gives the same figures on every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from geolimit.core.rule import Mode, Partition, Rule
from geolimit.sim.cluster import SimCluster
from geolimit.sim.oracle import Accuracy, Request, measure

__all__ = ["SCENARIOS", "Scenario", "run_scenario", "run_suite"]

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
    bursts: bool = False
    partition: tuple[float, float] | None = None  # (start, length) during which the last region is cut off
    skew: tuple[float, ...] | None = None  # clock offset per region (seconds)
    mode: Mode = "approximate"
    predict: bool = True
    policy: Partition = "local"
    seed: int = 7

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
    "bursts": Scenario("bursts", bursts=True),
    "partition-local": Scenario("partition-local", partition=(20.0, 20.0)),
    "partition-share": Scenario("partition-share", partition=(20.0, 20.0), policy="share"),
    "partition-closed": Scenario("partition-closed", partition=(20.0, 20.0), policy="closed"),
    "clock-skew": Scenario("clock-skew", skew=(0.0, 1.0, -1.0)),
}


@dataclass
class Outcome:
    scenario: Scenario
    variant: str  # "geolimit", "no replication", "static split"
    accuracy: Accuracy
    convergence: float | None = None  # seconds from heal to identical views
    extra: dict[str, Any] = field(default_factory=dict)


def arrivals(s: Scenario) -> list[tuple[float, str]]:
    """(time offset, region) of every request: Poisson, optionally bursty."""
    rng = random.Random(s.seed)
    rate = s.load * s.limit / s.window
    weights = list(s.weights or [1.0] * s.regions)
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        # bursts: 1 s at 4x the average rate, then 3 s at 2/3 of it (the same mean)
        local = rate * (4.0 if t % 4.0 < 1.0 else 2.0 / 3.0) if s.bursts else rate
        t += rng.expovariate(local)
        if t >= s.duration:
            return out
        out.append((t, rng.choices(s.names, weights)[0]))


async def run_scenario(redis_url: str, s: Scenario, variant: str = "geolimit") -> Outcome:
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


async def run_suite(redis_url: str, names: Sequence[str], duration: float | None = None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for name in names:
        scenario = SCENARIOS[name]
        if duration is not None:
            scale = duration / scenario.duration
            partition = scenario.partition
            if partition is not None:
                partition = (partition[0] * scale, partition[1] * scale)
            scenario = replace(scenario, duration=duration, partition=partition)
        for variant in ("geolimit", "no replication", "static split"):
            outcomes.append(await run_scenario(redis_url, scenario, variant))
    return outcomes


def pct(x: float) -> str:
    return f"{x:.2f}%" if math.isfinite(x) else "-"

"""Schedules of hits and faults run through the simulator, checked against the exact truth.

A :class:`~tests.sim.schedule.Schedule` is plain data. :func:`run_schedule`
drives a :class:`~geolimit.sim.SimCluster` (real Redis, real Lua, the real
``GossipEngine``, virtual time) through it and checks, per (rule, subject,
bucket, origin region):

* safety, after every step and every convergence round: no region's view
  exceeds the truth (the exact sum of the hits that origin made);
* liveness, after the final heal (every link up, faults and jitter off): within
  ``rounds_bound`` gossip rounds every region's view equals the truth and every
  region holds identical cells; then every region's app-facing ``usage`` agrees.

Wipes: a wipe destroys hits held only by the wiped Redis (no persistence), which
no protocol can bring back. A ``Wipe`` step is therefore only carried out once
every cell of the region is held (value for value) by at least one other region:
with ``sync=True`` the harness first heals everything and runs rounds (at most
``rounds_bound``) until that holds, then restores the partitions, faults and
jitter; with ``sync=False`` the wipe is skipped when it does not hold. Either way
the truth stays exact. (The outboxes live in the same Redis, so a wipe loses
them too: the condition covers that.)
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

from geolimit.core.gcounter import parse_slot_id
from geolimit.core.rule import Rule
from geolimit.core.window import bucket_of, count_of
from geolimit.replication.gossip import EngineSettings
from geolimit.sim import Faults, SimCluster
from tests.sim.schedule import (
    Advance,
    Cut,
    Heal,
    Hit,
    Isolate,
    Jitter,
    Rejoin,
    RestartAgent,
    Schedule,
    SetFaults,
    Step,
    Wipe,
)

RULES = (
    Rule("fine", 10**9, 600, 1, predict=False),  # 1 s buckets: keys span many buckets
    Rule("coarse", 10**9, 1200, 10, predict=False),
)
BY_NAME = {r.name: r for r in RULES}
INTERVAL = 0.1
#: Virtual seconds the steps of a run may last: with the convergence rounds after
#: them still far inside the shortest window, so no cell expires during a run.
MAX_VIRTUAL = 0.6 * min(r.window for r in RULES)
CHECK_EVERY = 0.5  # an Advance checks safety at least this often (virtual seconds)
#: Convergence within this many rounds needs no periodic anti-entropy (deltas, relays,
#: and the anti-entropy runs on start, reconnect and wipe); reported, not asserted.
FAST_ROUNDS = 40

Key = tuple[str, bytes, int, str]  # rule, subject, bucket, origin region
Cells = dict[tuple[str, bytes], list[tuple[int, str, int, int]]]


class Violation(AssertionError):
    """A safety or liveness property failed."""


@dataclass
class Outcome:
    rounds: int  # gossip rounds after the final heal until every view was exact
    steps: int = 0
    checks: int = 0  # safety checks passed
    wipes: int = 0
    wipes_skipped: int = 0
    sync_rounds: int = 0
    restarts: int = 0
    hits: int = 0
    virtual_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # engine stats summed over regions


#: Outcomes of the schedules run in this session (summarised by tests/sim/conftest.py).
RECORD: list[Outcome] = []


# -- the cluster -----------------------------------------------------------------


def rounds_bound(schedule: Schedule) -> int:
    """Gossip rounds after the final heal within which every view must be exact.

    The slowest repair the protocol promises: a retry after the longest backoff, a
    heartbeat, a relay's detour (the sender reports the failure at its next message), a few one-way latencies, plus one
    periodic anti-entropy (interval +20 % jitter) for what only anti-entropy finds.
    """
    e = EngineSettings(interval=INTERVAL)
    slack = e.max_backoff + e.heartbeat + 3 * max(e.interval, e.heartbeat) + 4 * schedule.latency
    return math.ceil((slack + 1.2 * schedule.ae_interval) / INTERVAL)


def cluster_for(schedule: Schedule, base_url: str) -> SimCluster:
    """The simulated regions of ``schedule``: a database each of the server at ``base_url``,
    or a key prefix each on a Redis Cluster (``redis+cluster://``)."""
    skew = {n: s for n, s in zip(schedule.names, schedule.skew, strict=False) if s}
    return SimCluster(
        base_url, schedule.names, RULES, interval=INTERVAL, latency=schedule.latency, skew=skew,
        seed=schedule.seed, shards=schedule.shards, settings={"anti_entropy_interval": schedule.ae_interval},
    )


def view_of(cells: Cells) -> dict[Key, int]:
    """Effective count per (rule, subject, bucket, origin region) of one region's cells."""
    out: Counter[Key] = Counter()
    for (rule, subject), found in cells.items():
        for bucket, slot, value, floor in found:
            count = max(0, count_of(value) - count_of(floor))
            if count:
                out[(rule, subject, bucket, parse_slot_id(slot)[0])] += count
    return dict(out)


def flat(cells: Cells) -> set[tuple[str, bytes, int, str, int, int]]:
    return {(r, s, *c) for (r, s), found in cells.items() for c in found}


class Harness:
    """Applies steps to a running cluster and keeps the truth."""

    def __init__(self, sim: SimCluster, schedule: Schedule) -> None:
        self.sim = sim
        self.schedule = schedule
        self.truth: Counter[Key] = Counter()
        self.outcome = Outcome(rounds=-1)
        self.started = sim.now
        self.where = "start"

    # -- steps ---------------------------------------------------------------

    async def apply(self, step: Step) -> None:
        sim, net = self.sim, self.sim.network
        if isinstance(step, Hit):
            await self.hit(step.region, self.schedule.subject(step.subject), step.rules.split("+"), step.cost)
        elif isinstance(step, Advance):  # checked every CHECK_EVERY virtual seconds on the way
            left = step.seconds
            while left > 1e-9:
                await sim.advance(min(left, CHECK_EVERY))
                left -= CHECK_EVERY
                if left > 1e-9:
                    await self.check_safety()
        elif isinstance(step, Cut):
            net.cut(step.a, step.b, step.both)
        elif isinstance(step, Heal):
            net.heal(step.a, step.b, step.both)
        elif isinstance(step, Isolate):
            net.isolate(step.region)
        elif isinstance(step, Rejoin):
            net.rejoin(step.region)
        elif isinstance(step, SetFaults):
            net.set_faults(step.a, step.b, Faults(step.drop_request, step.drop_response, step.duplicate), step.both)
        elif isinstance(step, Jitter):
            net.jitter = step.seconds
        elif isinstance(step, RestartAgent):
            await sim.restart_agent(step.region)
            self.outcome.restarts += 1
        elif isinstance(step, Wipe):
            await self.wipe(step.region, step.sync)
        else:  # pragma: no cover
            raise TypeError(f"unknown step {step!r}")
        if sim.now - self.started > MAX_VIRTUAL:
            raise RuntimeError(f"schedule too long: {sim.now - self.started:.1f} virtual s (cells would expire)")

    async def hit(self, region: str, subject: bytes, rules: list[str], cost: int) -> None:
        now_us = await self.sim.region_now_us(region, subject)  # the agreed clock the decision runs on
        decision = await self.sim.hit(region, rules, subject, cost)
        if not decision.allowed:
            raise Violation(f"{self.where}: a hit under a limit of 10**9 was denied: {decision!r}")
        for rule in rules:
            self.truth[(rule, subject, bucket_of(now_us, BY_NAME[rule].resolution_us), region)] += cost
        self.outcome.hits += 1

    async def missing_elsewhere(self, name: str) -> list[tuple[str, bytes, int, str, int, int]]:
        """Cells of ``name`` that no other region holds at least as high (a wipe would lose them)."""
        best: dict[tuple[str, bytes, int, str], tuple[int, int]] = {}
        for other in self.sim.names:
            if other != name:
                for rule, subject, bucket, slot, value, floor in flat(await self.sim.cells(other)):
                    have = best.get((rule, subject, bucket, slot), (0, 0))
                    best[(rule, subject, bucket, slot)] = (max(have[0], value), max(have[1], floor))
        missing = []
        for cell in flat(await self.sim.cells(name)):
            value, floor = best.get(cell[:4], (0, 0))
            if value < cell[4] or floor < cell[5]:
                missing.append(cell)
        return sorted(missing)

    async def wipe(self, name: str, sync: bool) -> None:
        net = self.sim.network
        missing = await self.missing_elsewhere(name)
        if missing and not sync:
            self.outcome.wipes_skipped += 1
            return
        if missing:
            saved = (set(net.cut_links), dict(net.faults), net.jitter)
            net.cut_links.clear()
            net.faults.clear()
            net.jitter = 0.0
            bound = rounds_bound(self.schedule)
            for _ in range(bound):
                await self.sim.advance(INTERVAL)
                self.outcome.sync_rounds += 1
                await self.check_safety()
                missing = await self.missing_elsewhere(name)
                if not missing:
                    break
            else:
                raise Violation(
                    f"{self.where}: with every link healed, {name}'s cells were still held nowhere else "
                    f"after {bound} rounds: {missing[:10]}"
                )
            net.cut_links.update(saved[0])
            net.faults.update(saved[1])
            net.jitter = saved[2]
        await self.sim.wipe(name)
        self.outcome.wipes += 1

    # -- checks --------------------------------------------------------------

    async def views(self) -> dict[str, Cells]:
        found = await asyncio.gather(*(self.sim.cells(name) for name in self.sim.names))
        return dict(zip(self.sim.names, found, strict=True))

    async def check_safety(self, views: dict[str, Cells] | None = None) -> None:
        """No region's view of any (rule, subject, bucket, origin) exceeds the truth."""
        views = views if views is not None else await self.views()
        for name, cells in views.items():
            over = {k: (v, self.truth.get(k, 0)) for k, v in view_of(cells).items() if v > self.truth.get(k, 0)}
            if over:
                raise Violation(
                    f"{self.where}: region {name}'s view exceeds the truth "
                    f"(key: (seen, truth)): {dict(sorted(over.items())[:10])}"
                )
        self.outcome.checks += 1

    def differences(self, views: dict[str, Cells]) -> dict[str, dict[Key, tuple[int, int]]]:
        truth = {k: v for k, v in self.truth.items() if v}
        out: dict[str, dict[Key, tuple[int, int]]] = {}
        for name, cells in views.items():
            seen = view_of(cells)
            diff = {k: (seen.get(k, 0), truth.get(k, 0)) for k in set(seen) | set(truth)
                    if seen.get(k, 0) != truth.get(k, 0)}
            if diff:
                out[name] = diff
        return out

    async def converge(self, rounds_bound: int, heal: bool = True) -> int:
        """Heal everything (unless not ``heal``), then run rounds until every view is exact.

        Returns the rounds needed; raises Violation after ``rounds_bound`` rounds.
        """
        net = self.sim.network
        if heal:
            net.cut_links.clear()
            net.faults.clear()
            net.jitter = 0.0
        self.where = "convergence"
        for rounds in range(rounds_bound + 1):
            if rounds:
                await self.sim.advance(INTERVAL)
            views = await self.views()
            await self.check_safety(views)
            if not self.differences(views) and len({frozenset(flat(c)) for c in views.values()}) == 1:
                self.outcome.rounds = rounds
                return rounds
        views = await self.views()
        diff = {n: dict(sorted(d.items())[:8]) for n, d in self.differences(views).items()}
        cells = {n: len(flat(c)) for n, c in views.items()}
        peers = {
            n: {p: (s.queued, s.failures, s.ae_needed, s.ae_ok, len(s.flying))
                for p, s in r.engine.peers.items()}
            for n, r in self.sim.regions.items()
        }
        raise Violation(
            f"not converged {rounds_bound} rounds after the final heal "
            f"(region: key: (seen, truth)): {diff}; cells per region: {cells}; "
            f"peers (outbox, failures, ae_needed, ae_ok, in flight): {peers}"
        )

    async def check_usage(self) -> None:
        """The apps' view (``usage``) agrees with the truth in every region's current window."""
        for name, region in self.sim.regions.items():
            for rule_name, subject in sorted({(k[0], k[1]) for k in self.truth}):
                now_us = await self.sim.region_now_us(name, subject)
                rule = BY_NAME[rule_name]
                current = bucket_of(now_us, rule.resolution_us)
                want: Counter[str] = Counter()
                for (r, s, bucket, origin), n in self.truth.items():
                    if (r, s) == (rule_name, subject) and current - rule.buckets <= bucket <= current and n:
                        want[origin] += n
                usage = await region.limiter.usage(rule_name, subject)
                seen = {origin: n for origin, n in usage.by_region.items() if n}
                if seen != dict(want) or usage.total != sum(want.values()):
                    raise Violation(
                        f"region {name}: usage({rule_name!r}, {subject!r}) = {usage.by_region} "
                        f"(total {usage.total}), truth {dict(want)}"
                    )


async def run_schedule(schedule: Schedule, base_url: str, rounds_bound: int) -> Outcome:
    """Run ``schedule`` on a fresh cluster (its DBs flushed); raises Violation on any failure."""
    async with cluster_for(schedule, base_url) as sim:
        harness = Harness(sim, schedule)
        harness.outcome.steps = len(schedule.steps)
        for i, step in enumerate(schedule.steps):
            harness.where = f"after step {i} {step!r}"
            await harness.apply(step)
            await harness.check_safety()
        await harness.converge(rounds_bound)
        await harness.check_usage()
        outcome = harness.outcome
        outcome.virtual_seconds = sim.now - harness.started
        for region in sim.regions.values():
            for key, value in region.engine.stats.items():
                outcome.stats[key] = outcome.stats.get(key, 0.0) + value
        return outcome

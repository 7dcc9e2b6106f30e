"""Random schedules of hits and faults: no view ever exceeds the truth, and all converge to it.

Each example is a :class:`~tests.sim.harness.Schedule` over 2-4 regions (mostly 3):
hits (a rule with a limit of 10**9, so every hit is admitted: this tests
replication, not limiting), virtual time, cuts and heals (one or both directions),
isolations, per-link message faults (dropped requests, dropped responses,
duplicates), jitter (reordering), agent crashes and Redis wipes, under optional
clock skew, with 1-64 shards per region. The truth is the exact sum of the hits
per (rule, subject, bucket, origin region); a hit's bucket is taken from the
hitting region's clock.

Properties (tests/sim/harness.py):

* safety, after every step (and every 0.5 virtual s inside a step): every
  region's count of every (rule, subject, bucket, origin) is <= the truth;
* liveness: after the final step, every link healed and faults and jitter off,
  every region's counts equal the truth exactly and all regions hold identical
  cells within ``rounds_bound(schedule)`` gossip rounds, and the apps' ``usage``
  agrees in every region.

Wipes are carried out only when the region's cells are held elsewhere (see the
harness docstring): hits that only a wiped Redis held are genuinely lost.

Every ``pytest`` runs 40 + 20 schedules (plus the explicit examples); ``pytest -m nightly``
runs the ``nightly`` twins of the two properties, with 500 + 250 schedules.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings

from tests.sim.harness import RECORD, rounds_bound, run_schedule
from tests.sim.profiles import SIM_SETTINGS, TIMEOUT
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
    Wipe,
)
from tests.sim.strategies import schedules

# Hand-written schedules that every run covers, whatever hypothesis draws.
FOUR_REGIONS_SKEWED = Schedule(
    steps=(
        Hit("a", 0, "fine+coarse", 3), Isolate("d"), Hit("d", 0, "fine", 5), Advance(0.35),
        Cut("a", "b", False), SetFaults("b", "c", 0.5, 0.5, 0.5), Jitter(0.3), Hit("b", 1, "coarse", 2),
        Advance(1.2), RestartAgent("c"), Hit("c", 0, "fine+coarse", 4), Advance(0.8), Rejoin("d"),
        Wipe("a"), Hit("a", 0, "fine", 1), Advance(2.0),
    ),
    regions=4, skew=(0.0, 1.0, -1.0, 0.35), latency=0.15, shards=4, seed=7, namespace=1, ae_interval=5.0,
)
TWO_REGIONS_CRASHES = Schedule(
    steps=(
        Hit("a", 0, "fine", 2), Hit("b", 0, "fine", 3), Advance(0.05), RestartAgent("a"), Cut("a", "b"),
        Hit("a", 0, "fine", 1), Advance(0.6), Wipe("b", False), Wipe("b"), RestartAgent("b"), Heal("a", "b"),
        Advance(0.4), Wipe("a"), RestartAgent("a"), Hit("a", 1, "coarse", 5), Advance(1.0),
    ),
    regions=2, shards=1, seed=3, namespace=2,
)
#: c's wipe lands while its initial anti-entropy is in flight: the repair the wipe asks for must
#: outlive that exchange (test_scenarios.py: test_a_wipe_during_a_running_anti_entropy_is_still_repaired_at_once).
WIPE_DURING_ANTI_ENTROPY = Schedule(
    steps=(
        Hit("c", 1, "fine+coarse", 2), RestartAgent("a"), Hit("c", 0, "fine+coarse", 2), Hit("c", 1, "coarse", 3),
        Wipe("c", True), Advance(0.75), Hit("a", 1, "fine", 5), Hit("a", 3, "fine+coarse", 4),
    ),
    skew=(0.0, -0.6, -0.6), latency=0.05, shards=4, seed=592, namespace=1230, ae_interval=30.0,
)
#: Steps that destroy state: agent crashes and Redis wipes, between bursts of hits and time.
CRASH_KINDS = ("hit", "hit", "hit", "advance", "advance", "restart", "wipe", "cut", "heal", "faults")


def check(schedule: Schedule, base_url: str) -> None:
    outcome = asyncio.run(run_schedule(schedule, base_url, rounds_bound(schedule)))
    RECORD.append(outcome)


def crash_settings(profile: str) -> settings:
    return settings(SIM_SETTINGS[profile], max_examples=max(10, SIM_SETTINGS[profile].max_examples // 2))


@pytest.mark.timeout(TIMEOUT["ci"])
@settings(SIM_SETTINGS["ci"])
@given(schedule=schedules())
@example(schedule=FOUR_REGIONS_SKEWED)
@example(schedule=TWO_REGIONS_CRASHES)
@example(schedule=WIPE_DURING_ANTI_ENTROPY)
def test_views_never_exceed_the_truth_and_converge_to_it(sim_redis: str, schedule: Schedule) -> None:
    check(schedule, sim_redis)


@pytest.mark.timeout(TIMEOUT["ci"])
@crash_settings("ci")
@given(schedule=schedules(kinds=CRASH_KINDS))
def test_crashes_and_wipes_lose_nothing_that_was_replicated(sim_redis: str, schedule: Schedule) -> None:
    check(schedule, sim_redis)


@pytest.mark.nightly
@pytest.mark.timeout(TIMEOUT["nightly"])
@settings(SIM_SETTINGS["nightly"])
@given(schedule=schedules())
def test_views_never_exceed_the_truth_and_converge_to_it_nightly(sim_redis: str, schedule: Schedule) -> None:
    check(schedule, sim_redis)


@pytest.mark.nightly
@pytest.mark.timeout(TIMEOUT["nightly"])
@crash_settings("nightly")
@given(schedule=schedules(kinds=CRASH_KINDS))
def test_crashes_and_wipes_lose_nothing_that_was_replicated_nightly(sim_redis: str, schedule: Schedule) -> None:
    check(schedule, sim_redis)

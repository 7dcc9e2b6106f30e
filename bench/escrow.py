"""Escrow mode in the simulator: over-admission, under-use and how fast rights travel.

    python bench/escrow.py [--quick] [--json PATH]

Pure Python in virtual time (the model of geolimit/core/escrow.py between
simulated regions, geolimit/sim/escrow.py): 3 regions, 50 ms one-way links,
gossip every 100 ms, the scenarios of ``geolimit bench accuracy``. Every figure
has same-run baselines measured by the same exact oracle:

* *exact*: one global exact sliding-window limiter that sees every request at once (the ideal);
* *no rebalance*: escrow with the rights frozen at the initial split (a static split
  with the same own-count precision), which is what rebalancing must beat.

Tables:

1. over-admission (must be 0) and under-use per scenario, for own steps per bucket 1, 2, 4, 8;
2. rights travel: after a first request in an idle cluster, how long until the busy
   region holds every unit the idle regions had spare (over 20 gossip phases);
3. bursts fired at all regions at once (3x the limit, 1 ms and 50 ms apart): admitted;
4. a limit change (SIGHUP) while rights have moved: rights before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit.sim.accuracy import (
    SCENARIOS,
    Scenario,
    arrivals,
    run_escrow_scenario,
    run_exact_scenario,
)
from geolimit.sim.escrow import EscrowCluster
from geolimit.sim.oracle import Request, measure

STEPS = (1, 2, 4, 8)
STUDIED = ("standard", "skewed", "bursts", "partition-local", "clock-skew", "handoff")


async def frozen(s: Scenario) -> dict[str, Any]:
    """Escrow with gossip off: every region keeps its initial share (the no-rebalance baseline)."""
    sim = EscrowCluster(s.names, s.limit, s.window, s.resolution, interval=s.interval, latency=s.latency,
                        seed=s.seed, steps=s.escrow_steps)
    sim.gossip = False
    sim.start()
    start = sim.clock.now_us()
    log: list[Request] = []

    async def decide(region: str) -> None:
        log.append(Request(sim.clock.now_us(), region, 1, sim.hit(region, b"user:42").allowed))

    for offset, region in arrivals(s):
        sim.scheduler.at(start + round(offset * 1e6), lambda region=region: decide(region))  # type: ignore[misc]
    await sim.run_until(start / 1e6 + s.duration)
    a = measure(log, s.limit, round(s.window * 1e6), start, start + round(s.duration * 1e6))
    return {"max_over": a.max_over, "under_use_pct": a.under_use_pct}


async def steps_table(names: tuple[str, ...], steps: tuple[int, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in names:
        exact = run_exact_scenario(SCENARIOS[name]).accuracy
        for k in steps:
            s = replace(SCENARIOS[name], escrow_steps=k)
            began = time.perf_counter()
            esc = (await run_escrow_scenario(s)).accuracy
            base = await frozen(s)
            rows.append({
                "scenario": name, "steps": k, "max_over": esc.max_over, "under_use_pct": esc.under_use_pct,
                "exact_under_use_pct": exact.under_use_pct, "frozen_max_over": base["max_over"],
                "frozen_under_use_pct": base["under_use_pct"], "wall_s": time.perf_counter() - began,
            })
            r = rows[-1]
            print(f"  {name:16} steps {k}: over {r['max_over']}, under-use {r['under_use_pct']:.2f}% "
                  f"(exact {r['exact_under_use_pct']:.2f}%, no rebalance {r['frozen_under_use_pct']:.2f}%)", flush=True)
    return rows


async def travel(seeds: int) -> dict[str, Any]:
    """Seconds from a first request in region a (idle cluster, 1000/60s) until a holds
    every unit b and c had spare."""
    took: list[float] = []
    for seed in range(seeds):
        sim = EscrowCluster(["a", "b", "c"], 1000, 60.0, 6.0, interval=0.1, latency=0.05, seed=seed)
        sim.start()
        await sim.advance(0.37 + 0.1 * (seed % 7) / 7)  # a little past the start, at a different phase
        began = sim.now
        sim.hit("a", b"s")
        while sim.rights("a", b"s") < 1000 and sim.now - began < 5:
            await sim.advance(0.001)
        took.append(sim.now - began)
    return {"median_s": statistics.median(took), "max_s": max(took), "runs": len(took)}


async def burst(limit: int, spacing: float) -> int:
    """3x the limit fired at all regions, ``spacing`` apart within each region: admitted."""
    sim = EscrowCluster(["a", "b", "c"], limit, 60.0, 6.0, interval=0.1, latency=0.05)
    sim.start()
    await sim.advance(0.5)
    admitted = 0
    for _ in range(limit):
        for region in ("a", "b", "c"):
            admitted += sim.hit(region, b"otp").allowed
        await sim.advance(spacing)
    return admitted


async def sighup() -> dict[str, Any]:
    """a is busy (30/60s), so b and c gave it their spare; then the limit goes to 60, then to 6."""
    sim = EscrowCluster(["a", "b", "c"], 30, 60.0, 6.0, interval=0.1, latency=0.05)
    sim.start()
    for _ in range(12):
        sim.hit("a", b"s")
    await sim.advance(1.0)
    out: dict[str, Any] = {"30": {n: sim.rights(n, b"s") for n in sim.names}}
    for limit in (60, 6):
        for name in sim.names:
            sim.set_limit(name, limit)
        out[str(limit)] = {n: sim.rights(n, b"s") for n in sim.names}
    out["a_allowed_after_6"] = sim.hit("a", b"s").allowed
    return out


async def main(quick: bool) -> dict[str, Any]:
    started = time.perf_counter()
    print("escrow mode, simulated (3 regions, 50 ms links, 100 ms gossip); baselines: exact limiter, no rebalance")
    print("\n1. over-admission and under-use by own steps per bucket")
    rows = await steps_table(("standard",) if quick else STUDIED, (1, 4) if quick else STEPS)
    print("\n2. rights travel (idle cluster, first request in a)")
    moved = await travel(5 if quick else 20)
    print(f"  a holds all 1000: median {moved['median_s'] * 1000:.0f} ms, max {moved['max_s'] * 1000:.0f} ms "
          f"over {moved['runs']} phases (bound: 2 intervals + 2 one-way latencies = 300 ms)")
    print("\n3. bursts of 3x the limit fired at all regions at once")
    bursts: dict[str, int] = {}
    for cap in (5, 100):
        for spacing in (0.001, 0.05):
            got = await burst(cap, spacing)
            bursts[f"{cap}@{spacing * 1000:g}ms"] = got
            print(f"  limit {cap:3}/60s, {spacing * 1000:2g} ms apart: admitted {got} of {3 * cap} "
                  f"({'PASS' if got <= cap else 'MISS'}: <= {cap})")
    print("\n4. limit change (SIGHUP) after b and c gave their spare to a")
    changed = await sighup()
    for limit in ("30", "60", "6"):
        print(f"  limit {limit:>2}: rights {changed[limit]} (sum {sum(changed[limit].values())})")
    verdict = "allowed" if changed["a_allowed_after_6"] else "denied"
    print(f"  a, holding 12 admissions, after the limit drops to 6: {verdict}")
    worst = max(r["max_over"] for r in rows)
    print(f"\nover-admission in every run: {worst} ({'PASS' if worst == 0 else 'MISS'}: 0)")
    std = [r for r in rows if r["scenario"] == "standard" and r["steps"] == 4]
    if std:
        u = std[0]["under_use_pct"]
        print(f"under-use, standard, 4 steps per bucket: {u:.2f}% ({'PASS' if u <= 5 else 'MISS'}: <= 5%)")
    print(f"({time.perf_counter() - started:.0f} s of wall time)")
    return {"steps": rows, "travel": moved, "bursts": bursts, "sighup": changed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="standard scenario only, fewer runs")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    figures = asyncio.run(main(args.quick))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2), encoding="utf-8")

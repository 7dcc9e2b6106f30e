"""``geolimit bench accuracy``: run the accuracy scenarios and print a table (and JSON)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from geolimit.errors import GeolimitError
from geolimit.sim.accuracy import SCENARIOS, Outcome, run_suite
from geolimit.store.embedded import EmbeddedRedis

__all__ = ["format_table", "run_accuracy_bench", "targets"]


def targets(outcomes: Sequence[Outcome]) -> list[tuple[str, str, str, bool]]:
    """(target, measured, goal, met) for the figures the issue asks for."""
    by = {(o.scenario.name, o.variant): o for o in outcomes}
    rows: list[tuple[str, str, str, bool]] = []
    std = by.get(("standard", "geolimit"))
    if std is not None:
        a = std.accuracy
        rows.append(("P3 max over-admission, standard", f"{a.max_over_pct:.2f}%", "<= 1%", a.max_over_pct <= 1.0))
        rows.append(("P4 under-use, standard", f"{a.under_use_pct:.2f}%", "<= 3%", a.under_use_pct <= 3.0))
    share = by.get(("partition-share", "geolimit"))
    if share is not None:
        a = share.accuracy
        rows.append(("share policy, 20 s partition", f"{a.max_over_pct:.2f}%", "<= 5%", a.max_over_pct <= 5.0))
    for name in ("partition-share", "partition-local", "partition-closed"):
        o = by.get((name, "geolimit"))
        if o is not None:
            bound = 2 * o.scenario.interval + 2 * o.scenario.latency
            took = o.convergence
            rows.append((
                f"P5 convergence after heal, {name}",
                "not reached" if took is None else f"{took * 1000:.0f} ms",
                f"<= {bound * 1000:.0f} ms (2 intervals + RTT)",
                took is not None and took <= bound,
            ))
    return rows


def format_table(outcomes: Sequence[Outcome]) -> str:
    head = (f"{'scenario':18} {'variant':15} {'max over':>9} {'mean over':>9} {'under-use':>9} "
            f"{'wrongly allowed':>15} {'wrongly denied':>14} {'admitted':>8}  per region")
    lines = [head, "-" * len(head)]
    for o in outcomes:
        a = o.accuracy
        regions = " ".join(f"{r}={n}" for r, n in sorted(a.admitted_by_region.items()))
        lines.append(
            f"{o.scenario.name:18} {o.variant:15} {a.max_over_pct:8.2f}% {a.mean_over_pct:8.2f}% "
            f"{a.under_use_pct:8.2f}% {a.wrongly_allowed_pct:14.2f}% {a.wrongly_denied_pct:13.2f}% "
            f"{a.admitted:8}  {regions}"
        )
    lines.append("")
    lines.append(f"{'target':48} {'measured':>12}  {'goal':32} verdict")
    for target, measured, goal, met in targets(outcomes):
        lines.append(f"{target:48} {measured:>12}  {goal:32} {'PASS' if met else 'MISS'}")
    return "\n".join(lines)


def _as_json(outcomes: Sequence[Outcome], elapsed: float) -> dict[str, Any]:
    return {
        "elapsed_seconds": round(elapsed, 1),
        "runs": [
            {
                "scenario": o.scenario.name,
                "variant": o.variant,
                "settings": {
                    "regions": o.scenario.regions, "latency": o.scenario.latency, "interval": o.scenario.interval,
                    "limit": o.scenario.limit, "window": o.scenario.window, "resolution": o.scenario.resolution,
                    "load": o.scenario.load, "duration": o.scenario.duration, "mode": o.scenario.mode,
                    "policy": o.scenario.policy, "predict": o.scenario.predict,
                },
                "accuracy": o.accuracy.as_dict(),
                "convergence_after_heal_s": o.convergence,
            }
            for o in outcomes
        ],
        "targets": [
            {"target": t, "measured": m, "goal": g, "met": ok} for t, m, g, ok in targets(outcomes)
        ],
    }


def run_accuracy_bench(
    scenarios: Sequence[str] | None = None,
    duration: float | None = None,
    json_path: str | None = None,
    redis_url: str | None = None,
) -> int:
    names = list(scenarios or SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"geolimit: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    logging.getLogger("geolimit").setLevel(logging.ERROR)  # partitions log failed sends by design
    started = time.perf_counter()
    with ExitStack() as stack:
        if redis_url is None:
            try:
                server = stack.enter_context(EmbeddedRedis())
            except GeolimitError as exc:
                print(f"geolimit: {exc}", file=sys.stderr)
                return 1
            redis_url = server.url
        base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
        print(f"geolimit bench accuracy: {len(names)} scenarios x 3 variants, "
              f"{duration or 60:g} s simulated each (virtual time, real Redis and Lua)", flush=True)
        outcomes = asyncio.run(run_suite(base, names, duration))
    elapsed = time.perf_counter() - started
    print(format_table(outcomes))
    print(f"\n({elapsed:.0f} s of wall time)")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            json.dump(_as_json(outcomes, elapsed), out, indent=2)
    return 0

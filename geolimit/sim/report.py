"""``geolimit bench accuracy``: run the accuracy scenarios and print a table (and JSON)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from geolimit.errors import GeolimitError
from geolimit.sim.accuracy import SCENARIOS, VARIANTS, Outcome, run_suite
from geolimit.store.embedded import EmbeddedRedis

__all__ = ["format_table", "outcome_rows", "pct", "run_accuracy_bench", "targets"]

PASS, MISS, INSUFFICIENT = "PASS", "MISS", "INSUFFICIENT"
#: The longest --duration, in simulated seconds: an hour (a simulated minute takes about 30 s of
#: wall time per scenario, so an hour takes about half an hour each); the CLI says the same.
MAX_DURATION = 3600.0


def pct(x: float) -> str:
    """A percentage, or ``-`` for a figure that could not be measured."""
    return f"{x:.2f}%" if math.isfinite(x) else "-"


def _verdict(outcome: Outcome, met: bool) -> str:
    return INSUFFICIENT if outcome.insufficient else PASS if met else MISS


def targets(outcomes: Sequence[Outcome]) -> list[tuple[str, str, str, str]]:
    """(target, measured, goal, verdict) for each accuracy target whose scenario ran (over-admission,
    under-use, wrong denials, convergence after a heal, handoff, escrow). The verdict is
    PASS, MISS, or INSUFFICIENT when the run was too short to say."""
    by = {(o.scenario.name, o.variant): o for o in outcomes}
    rows: list[tuple[str, str, str, str]] = []

    def row(o: Outcome, target: str, measured: str, goal: str, met: bool) -> None:
        rows.append((target, measured, goal, _verdict(o, met)))

    std = by.get(("standard", "geolimit"))
    if std is not None:
        a = std.accuracy
        row(std, "P3 max over-admission, standard", pct(a.max_over_pct), "<= 1%", a.max_over_pct <= 1.0)
        row(std, "P4 under-use, standard", pct(a.under_use_pct), "<= 3%", a.under_use_pct <= 3.0)
        row(std, "wrongly denied, standard", pct(a.wrongly_denied_pct), "<= 1%", a.wrongly_denied_pct <= 1.0)
    skew = by.get(("clock-skew", "geolimit"))
    if skew is not None:
        a = skew.accuracy
        row(skew, "max over-admission, +-1 s clock skew", pct(a.max_over_pct), "<= 2%", a.max_over_pct <= 2.0)
    share = by.get(("partition-share", "geolimit"))
    if share is not None:
        a = share.accuracy
        row(share, "share policy, 20 s partition", pct(a.max_over_pct), "<= 5%", a.max_over_pct <= 5.0)
    for name in ("partition-share", "partition-local", "partition-closed"):
        o = by.get((name, "geolimit"))
        if o is not None:
            bound = 2 * o.scenario.interval + 2 * o.scenario.latency
            took = o.convergence
            row(o, f"P5 convergence after heal, {name}", "not reached" if took is None else f"{took * 1000:.0f} ms",
                f"<= {bound * 1000:.0f} ms (2 intervals + RTT)", took is not None and took <= bound)
    for variant in ("geolimit", "escrow"):
        o = by.get(("handoff", variant))
        if o is not None:
            second = o.scenario.names[1]
            offered = round(o.scenario.load * o.scenario.limit) - round(o.scenario.load * o.scenario.limit) * 6 // 10
            got = o.accuracy.admitted_by_region.get(second, 0)
            if variant == "escrow":  # issue 10's target is the default mode's; escrow's figure is its cost
                rows.append((f"escrow: handoff, {second} admits", f"{got} of {offered}", "(cost, not a target)",
                             INSUFFICIENT if o.insufficient else "info"))
            else:
                row(o, f"{variant}: handoff, {second} admits", f"{got} of {offered}", ">= 95%", got >= 0.95 * offered)
    for o in outcomes:
        if o.variant != "escrow":
            continue
        a = o.accuracy
        row(o, f"escrow: over-admission, {o.scenario.name}", f"{a.max_over} over", "0", a.max_over == 0)
        if o.scenario.pattern in ("split-burst", "paced-burst"):
            row(o, f"escrow: burst admits, {o.scenario.name}", f"{a.admitted} of {a.requests}",
                f"<= {o.scenario.limit}", a.admitted <= o.scenario.limit)
    esc = by.get(("standard", "escrow"))
    if esc is not None:
        a = esc.accuracy
        row(esc, "escrow: under-use, standard", pct(a.under_use_pct), "<= 5%", a.under_use_pct <= 5.0)
    return rows


def outcome_rows(outcomes: Sequence[Outcome], scenario_width: int = 18, variant_width: int = 15) -> list[str]:
    """The header, a rule and one line per outcome: its accuracy figures and admissions by region."""
    sw, vw = scenario_width, variant_width
    head = (f"{'scenario':{sw}} {'variant':{vw}} {'max over':>9} {'mean over':>9} {'under-use':>9} "
            f"{'wrongly allowed':>15} {'wrongly denied':>14} {'admitted':>8}  per region")
    lines = [head, "-" * len(head)]
    for o in outcomes:
        a = o.accuracy
        regions = " ".join(f"{r}={n}" for r, n in sorted(a.admitted_by_region.items()))
        flag = "  (INSUFFICIENT)" if o.insufficient else ""
        lines.append(
            f"{o.scenario.name:{sw}} {o.variant:{vw}} {pct(a.max_over_pct):>9} {pct(a.mean_over_pct):>9} "
            f"{pct(a.under_use_pct):>9} {pct(a.wrongly_allowed_pct):>15} {pct(a.wrongly_denied_pct):>14} "
            f"{a.admitted:8}  {regions}{flag}"
        )
    return lines


def format_table(outcomes: Sequence[Outcome]) -> str:
    lines = outcome_rows(outcomes)
    short = {o.scenario.name: o.insufficient for o in outcomes if o.insufficient}
    if short:
        lines.append("")
        for reason in short.values():
            lines.append(f"INSUFFICIENT: {reason}; its figures say nothing about the targets. Run without --duration.")
    lines.append("")
    lines.append(f"{'target':48} {'measured':>12}  {'goal':32} verdict")
    for target, measured, goal, verdict in targets(outcomes):
        lines.append(f"{target:48} {measured:>12}  {goal:32} {verdict}")
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
                    "policy": o.scenario.policy, "predict": o.scenario.predict, "pattern": o.scenario.pattern,
                    "seed": o.scenario.seed,
                    "min_duration": o.scenario.min_duration,
                },
                "accuracy": o.accuracy.as_dict(),
                "convergence_after_heal_s": o.convergence,
                "insufficient": o.insufficient,
                **o.extra,
            }
            for o in outcomes
        ],
        "targets": [
            {"target": t, "measured": m, "goal": g, "verdict": v, "met": v == PASS} for t, m, g, v in targets(outcomes)
        ],
    }


def _progress(outcome: Outcome, done: int, total: int, took: float) -> None:
    a = outcome.accuracy
    note = "  INSUFFICIENT" if outcome.insufficient else ""
    print(f"  [{done:>{len(str(total))}}/{total}] {outcome.scenario.name:18} {outcome.variant:15} {took:5.1f} s"
          f"  max over {pct(a.max_over_pct)}, under-use {pct(a.under_use_pct)}{note}", flush=True)


def run_accuracy_bench(
    scenarios: Sequence[str] | None = None,
    duration: float | None = None,
    json_path: str | None = None,
    redis_url: str | None = None,
    seed: int | None = None,
) -> int:
    names = list(scenarios or SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"geolimit: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    if duration is not None and not (math.isfinite(duration) and 0 < duration <= MAX_DURATION):  # nan: never ends
        print(f"geolimit: --duration must be a number of seconds greater than 0 and at most {MAX_DURATION:g}, "
              f"got {duration!r}", file=sys.stderr)
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
        simulated = f"{duration:g} s" if duration is not None else "60-72 s"
        seeded = f", seed {seed}" if seed is not None else ""
        print(f"geolimit bench accuracy: {len(names)} scenarios x {len(VARIANTS)} variants "
              f"({', '.join(VARIANTS)}), {simulated} simulated each{seeded} (virtual time; real Redis and Lua "
              "for the gossip variants, the pure escrow model for escrow)", flush=True)
        outcomes = asyncio.run(run_suite(base, names, duration, progress=_progress, seed=seed))
    elapsed = time.perf_counter() - started
    print(format_table(outcomes))
    print(f"\n({elapsed:.0f} s of wall time)")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            json.dump(_as_json(outcomes, elapsed), out, indent=2)
    return 0

"""The soak's report (bench/soak.py): its figures summarized and printed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _agents import (
    LoadResult,
    LoadSpec,
    call_latency,
    cpu_per_decision,
    cpus_busy,
    failures,
    rate,
)
from _common import quantile

REGIONS = ("us-east", "eu-west", "ap-south")
ROW_EVERY, STATUS_EVERY, PROBE_EVERY, CONVERGE_WAIT = 10.0, 1.0, 1.0, 60.0
RSS_BAND, CONVERGE_TARGET = 0.20, 2.0


@dataclass
class Samples:
    status: list[dict[str, Any]] = field(default_factory=list)  # every STATUS_EVERY: t, links
    rows: list[dict[str, Any]] = field(default_factory=list)  # every ROW_EVERY: the printed table
    probes: list[float] = field(default_factory=list)
    probes_lost: int = 0
    status_errors: int = 0
    cpu_start: dict[str, float] = field(default_factory=dict)
    failures_start: dict[str, int] = field(default_factory=dict)  # counted before the load (agents' start-up)



# -- the report -----------------------------------------------------------------------------------


def summarize_run(results: list[LoadResult], bases: list[dict[str, Any]], samples: Samples, conv: dict[str, Any],
                  final: dict[str, Any], exits: dict[str, int | None], logs: dict[str, tuple[int, list[str]]],
                  cpu: dict[str, float], load_seconds: float, seconds: float) -> dict[str, Any]:
    total, per = rate(results)
    base = [rate(b["results"]) for b in bases]
    # Warm-up: the first quarter of the load, or until the live keys reach 90% of their
    # count at the end of the load (the working set has stopped growing), whichever is later.
    loaded = [r for r in samples.rows if r["phase"] == "load"]
    keys_end = loaded[-1]["keys"] if loaded else 0
    warmup = max(seconds / 4, next((r["t"] for r in loaded if r["keys"] >= 0.9 * keys_end), 0.0))
    rss: dict[str, dict[str, Any]] = {}
    for region in REGIONS:
        xs = [r["rss_mib"][region] for r in samples.rows
              if r["phase"] == "load" and r["t"] >= warmup and r["rss_mib"][region] is not None]
        lo, hi = (min(xs), max(xs)) if xs else (math.nan, math.nan)
        rss[region] = {"min": lo, "max": hi, "spread": hi / lo - 1, "flat": bool(xs) and hi <= (1 + RSS_BAND) * lo}
    during = [s for s in samples.status if s["load"]]
    lags = [v["lag"] for s in during for v in s["links"].values()]
    mid = (warmup + seconds) / 2
    outbox: dict[str, dict[str, Any]] = {}
    for link in sorted({k for s in samples.status for k in s["links"]}):
        def series(lo: float, hi: float, link: str = link) -> list[int]:
            return [s["links"][link]["outbox"] for s in during if link in s["links"] and lo <= s["t"] < hi]
        first, second = quantile(series(warmup, mid), 0.5), quantile(series(mid, math.inf), 0.5)
        peak = max((s["links"][link]["outbox"] for s in samples.status if link in s["links"]), default=0)
        region, _, peer = link.partition(">")
        left = final.get(region, {}).get("peers", {}).get(peer, {}).get("outbox")
        outbox[link] = {"max": peak, "median_first_half": first, "median_second_half": second, "after": left,
                        "bounded": second <= 1.5 * first + 1000 and left == 0}
    peers = {f"{reg}>{p}": v for reg, st in final.items() for p, v in st.get("peers", {}).items()}
    ae = {link: {k: v.get("anti_entropy", {}).get(k) for k in ("running", "ok", "failures", "seconds", "keys_scanned")}
          for link, v in peers.items()}
    errors = {
        "load": sum(r.errors for r in results), "load_examples": sorted({e for r in results for e in r.error_samples}),
        **{k: v - samples.failures_start.get(k, 0) for k, v in failures(final).items()},
        "before_load": samples.failures_start,
        "agent_log": sum(k for k, _ in logs.values()),
        "agent_log_examples": {reg: ex for reg, (_, ex) in logs.items() if ex},
        "agent_bad_exits": sum(c != 0 for c in exits.values()) + sum("error" in st for st in final.values()),
        "status_unreachable": samples.status_errors, "probes_lost": samples.probes_lost,
    }
    count = sum(v for v in errors.values() if isinstance(v, int))
    conv_s = conv["converged_s"]
    return {
        "load_seconds": load_seconds, "decisions": sum(r.decisions for r in results),
        "decisions_per_s": total, "decisions_per_s_by_region": per,
        "baseline_per_s": {"before": base[0][0], "after": base[1][0], "mean": (base[0][0] + base[1][0]) / 2,
                           "by_region": [b[1] for b in base]},
        "cpu_us_per_decision": cpu_per_decision(cpu, results), "cpu": cpu, "baseline_cpu": [b["cpu"] for b in bases],
        "latency": call_latency(results), "baseline_latency": [call_latency(b["results"]) for b in bases],
        "busy": cpus_busy(cpu, results), "baseline_busy": [cpus_busy(b["cpu"], b["results"]) for b in bases],
        "baseline_cpu_us_per_decision": [cpu_per_decision(b["cpu"], b["results"]) for b in bases],
        "cells_sent_per_decision": sum(v.get("cells_sent", 0) for v in peers.values()) / max(1, sum(r.decisions for r in results)),
        "warmup_s": warmup, "rss": rss, "rows": samples.rows,
        "lag": {"samples": len(lags), "p50": quantile(lags, 0.5), "p99": quantile(lags, 0.99), "max": max(lags, default=math.nan)},
        "probe": {"n": len(samples.probes), "p50": quantile(samples.probes, 0.5), "p99": quantile(samples.probes, 0.99),
                  "max": max(samples.probes, default=math.nan), "lost": samples.probes_lost},
        "outbox": outbox, "anti_entropy": ae, "convergence": conv, "errors": errors, "error_count": count, "exit_codes": exits,
        "verdicts": {
            "outboxes bounded": bool(outbox) and all(o["bounded"] for o in outbox.values()),
            f"agent RSS flat within {RSS_BAND:.0%} after warm-up": all(v["flat"] for v in rss.values()),
            f"every sampled subject exact in every region within {CONVERGE_TARGET:g} s":
                conv_s is not None and conv_s <= CONVERGE_TARGET and conv["exact"] == conv["sampled"],
            "0 errors": count == 0,
        },
        "final_status": final,
    }


def report(r: dict[str, Any]) -> None:
    b, src = r["baseline_per_s"], r["source"]
    dirty = f" + uncommitted changes in {len(src['dirty'])} files under geolimit/" if src["dirty"] else ""
    dirty += "" if src["head"] else f"(not a git checkout: {Path(__file__).resolve().parent.parent})"
    print(f"\n== soak: {r['minutes']:g} min, {r['subjects']} subjects, rule {r['rule']}, redis {r['redis']},"
          f" geolimit {src['head']}{dirty}")
    print(f"decisions/s   {r['decisions_per_s']:.0f} total (" + ", ".join(f"{k} {v:.0f}" for k, v in r["decisions_per_s_by_region"].items())
          + f"); {r['decisions']} decisions in {r['load_seconds']:.1f} s")
    print(f"  baseline    {b['mean']:.0f} total: the same load processes on the same redis-servers, no agents running"
          f" ({b['before']:.0f} before, {b['after']:.0f} after the soak, {r['baseline_seconds'] / 2:g} s each)"
          f" -> soak/baseline {r['decisions_per_s'] / b['mean']:.2f}")
    c, bc = r["cpu_us_per_decision"], r["baseline_cpu_us_per_decision"]
    print(f"CPU/decision  redis {c['redis']:.1f} us, agents {c['agent']:.1f} us, load {c['load']:.1f} us"
          f" (baseline: redis {bc[0]['redis']:.1f}/{bc[1]['redis']:.1f} us, load {bc[0]['load']:.1f}/{bc[1]['load']:.1f} us);"
          f" gossip cells sent per decision {r['cells_sent_per_decision']:.2f}")
    lat, blat = r["latency"], r["baseline_latency"]
    print(f"latency       one hit_many call of {LoadSpec.batch} decisions ({LoadSpec.lanes} per load process share one AsyncLimiter): p50 {lat['p50'] * 1e3:.1f} ms,"
          f" p99 {lat['p99'] * 1e3:.1f} ms, max {lat['max'] * 1e3:.0f} ms (baseline: p99 "
          + "/".join(f"{b['p99'] * 1e3:.1f}" for b in blat) + " ms, max " + "/".join(f"{b['max'] * 1e3:.0f}" for b in blat) + " ms)")
    print(f"CPUs busy     during the soak: {r['busy']}; baseline: " + " / ".join(r["baseline_busy"]))
    print(f"RSS           after warm-up (t >= {r['warmup_s']:.0f} s: a quarter of the load, and live keys at 90% of their final count): "
          + "; ".join(f"{k} {v['min']:.0f}-{v['max']:.0f} MiB ({v['spread']:+.0%})" for k, v in r["rss"].items()))
    lag, pr = r["lag"], r["probe"]
    print(f"gossip lag    outbox age (/v1/status each {STATUS_EVERY:g} s, 6 links, {lag['samples']} samples): p50 {lag['p50']:.2f} s,"
          f" p99 {lag['p99']:.2f} s, max {lag['max']:.2f} s")
    print(f"              probe (a hit until both other regions count it): n {pr['n']}, p50 {pr['p50']:.2f} s,"
          f" p99 {pr['p99']:.2f} s, max {pr['max']:.2f} s, lost {pr['lost']}")
    print("outbox max    " + "; ".join(f"{k} {v['max']} (median {v['median_first_half']:.0f} -> {v['median_second_half']:.0f},"
                                        f" after {v['after']})" for k, v in r["outbox"].items()))
    print("anti-entropy  at the end (per link: runs ok, running, last run's seconds / keys scanned): " + "; ".join(
        f"{k} {v['ok']}{' +1 running' if v['running'] else ''} ({v['seconds']} s / {v['keys_scanned']})" for k, v in r["anti_entropy"].items()))
    cv = r["convergence"]
    when = (f"not within {CONVERGE_WAIT:g} s" if cv["converged_s"] is None else
            f"within {cv['converged_s']:.2f} s (last seen inexact at {cv['last_inexact_s']:.2f} s;"
            f" the first reads began {cv['reads_began_s']:.2f} s after the stop)")
    print(f"convergence   {cv['sampled']} sampled subjects ({cv['random']} random + {cv['tail']} hit in the last {LoadSpec.tail_seconds:g} s)"
          f" exact in every region {when} after the load stopped ({cv.get('uncertain', 0)} hit by calls that timed out:"
          f" equal everywhere and within their uncertain hits); sweeps: "
          + ", ".join(f"{p['at']:.2f}s {p['inexact']} left" for p in cv["sweeps"][:8]))
    print(f"              usage by region (the limiter's reading) at {cv['checked_at']:.1f} s: exact {cv['exact']}/{cv['sampled']}"
          + (f"; e.g. {cv['first_inexact']}" if cv["first_inexact"] else ""))
    e = r["errors"]
    print(f"errors        {r['error_count']}: " + ", ".join(f"{k} {v}" for k, v in e.items() if isinstance(v, int)))
    for region, lines in e["agent_log_examples"].items():
        print("\n".join(f"              {region}: {line}" for line in lines))
    print("\n".join(f"              load: {line}" for line in e["load_examples"]))
    print("\n".join(f"{'PASS' if ok else 'MISS'}  {name}" for name, ok in r["verdicts"].items()))
    print("      (bounded: per link, the median outbox of the second half of the load <= 1.5x the first half's"
          " (after warm-up) + 1000 keys, and 0 once converged; errors count from the start of the load)")

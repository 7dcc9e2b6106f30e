"""Local single-Redis benchmarks of geolimit, each against a baseline measured in the same run.

    python bench/local.py [--redis-url URL] [--quick] [--json PATH] [--no-pin] [--only p1,p9]

Starts its own loopback redis-server (geolimit.store.embedded; GEOLIMIT_REDIS_SERVER picks
the binary) unless --redis-url is given (loopback only; the keys it creates are deleted).

P1  sync Limiter.hit latency vs bare redis-py INCR (verdict on one hot key; 10k subjects too)
P2  AsyncLimiter.hit throughput with 64 tasks vs limits' async sliding-window counter
P7  Redis memory per active key: 3 regions' slots x 10 one-second buckets
P9  strict-mode over-admission vs an exact sliding-log oracle on a bursty trace
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import limits
import limits.aio.storage
import limits.aio.strategies
import limits.storage
import limits.strategies
import redis
import redis.asyncio
from _common import (
    LoadMeter,
    Row,
    Server,
    cleanup,
    commandstats,
    cpu_seconds,
    cycling,
    delete_prefix,
    interleave,
    median,
    open_server,
    paired_ratio,
    print_table,
    quantile,
    require,
    script_stats,
    source_state,
    us,
)
from _trace import (
    Event,
    admission_stats,
    limits_swc_memory,
    make_trace,
    oracle_admit,
    p1_diagnosis,
    replay_limits_memory,
)

from geolimit import AsyncLimiter, Limiter, ManualClock, Rule
from geolimit.core.window import field_of

HUGE = 10**12  # every hit is allowed, so every hit takes the writing path
Result = tuple[list[Row], dict[str, Any]]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# -- P1: sync latency ------------------------------------------------------------------


def p1(server: Server, quick: bool) -> Result:
    chunk, rounds = 100, (60 if quick else 300)
    lim = Limiter.from_url(server.url, region="us-east", rules=[Rule("p1", HUGE, 60)], prefix="bp1")
    r = redis.Redis.from_url(server.url)
    lstore = limits.storage.RedisStorage(server.url, key_prefix="bp1l")
    lstrat = limits.strategies.SlidingWindowCounterRateLimiter(lstore)
    item = limits.parse("1000000000/minute")
    spread = [f"user:{i}" for i in range(10_000)]
    random.Random(1).shuffle(spread)
    out: dict[str, Any] = {"chunk": chunk, "rounds": rounds}
    rows: list[Row] = []
    for pattern, subjects in (("hot", ["hot-subject"]), ("spread10k", spread)):
        keys = [f"bp1i:{s}" for s in subjects]
        cands = {
            "incr": cycling(r.incr, keys),
            "geolimit": cycling(functools.partial(lim.hit, "p1"), subjects),
            "limits": cycling(functools.partial(lstrat.hit, item), subjects),
        }
        for run in cands.values():  # warm-up: connections, scripts, every key exists
            run(max(2000, len(subjects)))
        require(lim.hit("p1", subjects[0]).allowed and lstrat.hit(item, subjects[0]), "P1 hit denied")
        samples = interleave(cands, chunk, rounds)
        med = {k: median(v) for k, v in samples.items()}
        g = out[pattern] = {
            "median_s": med,
            "p10_s": {k: quantile(v, 0.1) for k, v in samples.items()},
            "p90_s": {k: quantile(v, 0.9) for k, v in samples.items()},
            "ratio_geolimit_incr": med["geolimit"] / med["incr"],
            "paired_ratio_geolimit_incr": paired_ratio(samples["geolimit"], samples["incr"]),
            "ratio_limits_incr": med["limits"] / med["incr"],
            "paired_ratio_limits_incr": paired_ratio(samples["limits"], samples["incr"]),
        }
        for who, goal in (("geolimit", "<= 1.2"), ("limits", "(context)")):
            ratio = g[f"ratio_{who}_incr"]
            rows.append(Row(
                f"P1 sync {'hit' if who == 'geolimit' else 'ctx: limits SWC'}, {pattern}",
                us(med[who]), f"INCR {us(med['incr'])}",
                f"{ratio:.3f} (paired {g[f'paired_ratio_{who}_incr']:.3f})", goal,
                "info" if who == "limits" else verdict(ratio <= 1.2) if pattern == "hot"
                else f"info ({verdict(ratio <= 1.2)})",
            ))
    out["diagnosis"] = p1_diagnosis(server, lim, r, lambda: lstrat.hit(item, "hot-subject"), quick)
    lim.close()
    r.close()
    cleanup(server.url, "bp1:*", "bp1#*", "bp1i:*", "bp1l:*")
    return rows, out


# -- P2: async throughput --------------------------------------------------------------


async def p2_async(server: Server, quick: bool) -> Result:
    # many short trials, candidates rotated: the same interleaving rule as P1, per trial
    tasks_n, trials, duration = 64, (4 if quick else 20), (0.4 if quick else 0.5)
    geo = AsyncLimiter.from_url(server.url, region="us-east", rules=[Rule("p2", HUGE, 60)], prefix="bp2")
    # context: the same limiter with max_batch=32, so the 64 callers fill both in-flight lanes
    geo32 = AsyncLimiter.from_url(server.url, region="us-east", rules=[Rule("p2", HUGE, 60)],
                                  prefix="bp2", max_batch=32)
    lstore = limits.aio.storage.RedisStorage(
        "async+" + server.url, implementation="redispy", key_prefix="bp2l"
    )
    lstrat = limits.aio.strategies.SlidingWindowCounterRateLimiter(lstore)
    item = limits.parse("1000000000/minute")
    ar = redis.asyncio.Redis.from_url(server.url)
    admin = redis.Redis.from_url(server.url)
    subjects = [f"user:{i}" for i in range(1000)]
    incr_keys = [f"bp2i:{s}" for s in subjects]
    cands: dict[str, Callable[[int], Awaitable[object]]] = {
        "geolimit": lambda i: geo.hit("p2", subjects[i % 1000]),
        "limits": lambda i: lstrat.hit(item, subjects[i % 1000]),
        "incr_async": lambda i: ar.incr(incr_keys[i % 1000]),
        "geolimit_max_batch32": lambda i: geo32.hit("p2", subjects[i % 1000]),
    }

    async def drive(call: Callable[[int], Awaitable[object]], seconds: float) -> tuple[int, float]:
        deadline = time.perf_counter() + seconds
        counts = [0] * tasks_n

        async def worker(k: int) -> None:
            i, n = k, 0
            while n < 1_000_000 and time.perf_counter() < deadline:
                await call(i)
                i, n = i + tasks_n, n + 1
            counts[k] = n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(tasks_n)))
        return sum(counts), time.perf_counter() - t0

    for call in cands.values():
        await drive(call, 0.3)
    require((await geo.hit("p2", "x")).allowed and await lstrat.hit(item, "x"), "P2 hit denied")
    rates: dict[str, list[float]] = {k: [] for k in cands}
    stats: dict[str, list[dict[str, float]]] = {k: [] for k in cands}
    names = list(cands)
    for t in range(trials):
        for name in names[t % len(names):] + names[: t % len(names)]:
            admin.config_resetstat()
            cpu0, srv0 = time.process_time(), cpu_seconds(admin)
            n, el = await drive(cands[name], duration)
            cpu1, srv1 = time.process_time(), cpu_seconds(admin)
            stats = commandstats(admin)
            cmd = stats.get("incrby", {}) if name == "incr_async" else script_stats(stats)
            calls = float(cmd.get("calls", 0))
            rates[name].append(n / el)
            stats[name].append({
                "decisions": n, "calls": calls, "decisions_per_call": n / calls if calls else 0.0,
                "usec_per_call": float(cmd.get("usec_per_call", 0.0)),
                "server_cmd_busy": float(cmd.get("usec", 0)) / 1e6 / el,
                "server_cpu": (srv1 - srv0) / el, "bench_cpu": (cpu1 - cpu0) / el,
            })
    await geo.aclose()
    await geo32.aclose()
    await ar.aclose()
    admin.close()
    med = {k: median(v) for k, v in rates.items()}
    ratio = med["geolimit"] / med["limits"]
    paired = paired_ratio(rates["geolimit"], rates["limits"])
    out = {"tasks": tasks_n, "trials": trials, "duration_s": duration, "rates": rates,
           "median_per_s": med, "ratio_geolimit_limits": ratio, "paired_ratio": paired,
           "per_trial": stats}
    rows = [
        Row("P2 async hit, 64 tasks", f"{med['geolimit']:,.0f}/s", f"limits SWC {med['limits']:,.0f}/s",
            f"{ratio:.2f}x (paired {paired:.2f}x)", ">= 5x", verdict(ratio >= 5)),
        Row("P2 ctx: async INCR, 64 tasks", f"{med['incr_async']:,.0f}/s",
            f"limits SWC {med['limits']:,.0f}/s", f"{med['incr_async'] / med['limits']:.2f}x",
            "(context)", "info"),
        Row("P2 ctx: geolimit max_batch=32", f"{med['geolimit_max_batch32']:,.0f}/s",
            f"limits SWC {med['limits']:,.0f}/s", f"{med['geolimit_max_batch32'] / med['limits']:.2f}x",
            "(context)", "info"),
    ]
    return rows, out


def p2(server: Server, quick: bool) -> Result:
    result = asyncio.run(p2_async(server, quick))
    cleanup(server.url, "bp2:*", "bp2#*", "bp2i:*", "bp2l:*")
    return result


# -- P7: memory per key ----------------------------------------------------------------


def p7_scenario(url: str, n: int, buckets: int, lo: int, hi: int) -> dict[str, Any]:
    """n subjects hit for ``buckets`` consecutive 1 s buckets in 3 regions, counts in lo..hi.

    Slot 0 (this region) is written by a real Limiter; slots 1 and 2 (eu-west, ap-south)
    are written as the replication agent will: HSET of field slot * M + bucket % M.
    """
    rule = Rule("p7", limit=HUGE, window=10, resolution=1)  # N=10, F=2, ring M=13
    clock = ManualClock(1_700_000_000.5)
    lim = Limiter.from_url(url, region="us-east", rules=[rule], prefix="g7", clock=clock)
    admin = redis.Redis.from_url(url)
    rng = random.Random(7)
    subjects = [f"user:{i}" for i in range(n)]
    layout = lim.layout
    for b in range(buckets):
        bucket = clock.now_us() // rule.resolution_us
        pipe = admin.pipeline(transaction=False)
        for s in subjects:
            lim.hit("p7", s, cost=rng.randint(lo, hi))
            key = layout.data_key("p7", s.encode())
            for slot in (1, 2):
                pipe.hset(key, str(field_of(slot, bucket, rule.ring)), rng.randint(lo, hi))
        for shard in range(layout.shards) if b == 0 else ():  # the agent registers the peers
            pipe.hset(layout.registry_key(shard), mapping={
                "eu-west/18c2f3a1b2c3d0a1b2c": 1, "ap-south/18c2f3a1b4f6e0d4e5f": 2, "#": 3})
        pipe.execute()
        clock.advance(1.0)
    keys = [layout.data_key("p7", s.encode()) for s in subjects]
    pipe = admin.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
        pipe.hlen(key)
    res = pipe.execute()
    mem, hlen = [int(x) for x in res[0::2]], [int(x) for x in res[1::2]]
    aux = [admin.memory_usage(k, samples=0) or 0 for k in admin.scan_iter(match="g7:{*}#*")]
    out = {"subjects": n, "buckets": buckets, "count_range": [lo, hi], "median_bytes": median(mem),
           "max_bytes": max(mem), "fields_median": median(hlen),
           "encoding": bytes(admin.object("encoding", keys[0]) or b"?").decode(),
           "key_example": keys[0].decode(), "aux_bytes_per_subject": sum(aux) / n}
    lim.close()
    delete_prefix(admin, "g7:*")
    delete_prefix(admin, "g7#*")
    admin.close()
    return out


def p7(server: Server, quick: bool) -> Result:
    n = 200 if quick else 1000
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    if any(next(admin.scan_iter(match=m), None) is not None for m in ("g7:*", "g7#*")):
        raise SystemExit("keys g7:* or g7#* already exist on this Redis; refusing to touch them")
    config = admin.config_get("hash-max-*")
    admin.close()
    scen = {  # value ranges: listpack int 7-bit (1 B) / 13-bit (2 B) / 16-bit (3 B) / 24-bit (4 B)
        "10b 1-500": p7_scenario(server.url, n, 10, 1, 500),
        "steady 20b 1-500": p7_scenario(server.url, n, 20, 1, 500),
        "10b 128-4095": p7_scenario(server.url, n, 10, 128, 4095),
        "10b 4096-32767": p7_scenario(server.url, n, 10, 4096, 32767),
        "10b 32768-8388607": p7_scenario(server.url, n, 10, 32768, 8_388_607),
    }
    base = limits_swc_memory(server.url, n)
    rows = []
    for name, s in scen.items():
        head = name == "10b 1-500"
        rows.append(Row(
            f"P7 bytes/key 3 slots, {name}" + (f" ({s['encoding']})" if head else ""),
            f"{s['median_bytes']:.0f} B (max {s['max_bytes']})",
            f"limits SWC {base['median_bytes']:.0f} B",
            f"{s['median_bytes'] / base['median_bytes']:.2f}x", "<= 300 B" if head else "(context)",
            verdict(s["max_bytes"] <= 300) if head else ("ok" if s["max_bytes"] <= 300 else "over"),
        ))
    return rows, {"config": config, "scenarios": scen, "limits_swc": base}


# -- P9: accuracy on a trace -------------------------------------------------------------


def replay_geolimit(url: str, events: list[Event], mode: Any, limit: int) -> list[bool]:
    rule = Rule("p9", limit=limit, window=10, resolution=1, mode=mode)
    clock = ManualClock(events[0].t_us / 1e6)
    prefix = f"bp9{mode[0]}"
    lim = Limiter.from_url(url, region="us-east", rules=[rule], prefix=prefix, clock=clock)
    admitted = []
    for e in events:
        clock.advance_us(e.t_us - clock.now_us())
        admitted.append(lim.hit("p9", e.subject, cost=e.cost).allowed)
    lim.close()
    cleanup(url, prefix + ":*", prefix + "#*")
    return admitted


def p9(server: Server, quick: bool) -> Result:
    limit, window_s = 100, 10
    window_us = window_s * 1_000_000
    events = make_trace(9, 3 if quick else 6, 120 if quick else 300, limit, window_s)
    t0 = time.perf_counter()
    runs = {"geolimit_strict": replay_geolimit(server.url, events, "strict", limit)}
    replay_s = time.perf_counter() - t0  # must stay far below the keys' 14 s real-time TTL
    runs["geolimit_approx"] = replay_geolimit(server.url, events, "approximate", limit)
    runs["limits_moving_mem"] = replay_limits_memory(events, "moving", limit, window_s)
    runs["limits_swc_mem"] = replay_limits_memory(events, "swc", limit, window_s)
    oracle = oracle_admit(events, limit, window_us)
    stats = {name: admission_stats(events, adm, oracle, limit, window_us)
             for name, adm in {"oracle": oracle, **runs}.items()}
    s, o = stats["geolimit_strict"], stats["oracle"]
    so, oo = s["over_admission"], o["over_admission"]
    rows = [
        Row("P9 strict over-admissions", f"{so['windows']} windows (max +{so['max_excess']})",
            f"oracle {oo['windows']}", "-", "0", verdict(so["windows"] == 0)),
        Row("P9 strict admitted cost", f"{s['admitted_cost']}", f"oracle {o['admitted_cost']}",
            f"{s['admitted_cost'] / o['admitted_cost']:.3f}", "(report)", "info"),
        Row("P9 strict under-admission", f"{s['oracle_yes_this_no_frac']:.2%} of reqs",
            f"exact-on-own-history {s['denied_but_exact_would_admit_frac']:.2%}", "-", "(report)", "info"),
    ]
    for name in ("geolimit_approx", "limits_moving_mem", "limits_swc_mem"):
        x = stats[name]
        rows.append(Row(
            f"P9 ctx: {name} over-admissions",
            f"{x['over_admission']['windows']} windows (max +{x['over_admission']['max_excess']})",
            f"admitted cost {x['admitted_cost']}", f"{x['admitted_cost'] / o['admitted_cost']:.3f}",
            "(context)", "info"))
    out = {"requests": len(events), "subjects": len({e.subject for e in events}),
           "offered_cost": sum(e.cost for e in events), "strict_replay_s": replay_s, "limiters": stats}
    return rows, out


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", help="use this loopback Redis instead of starting one")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and subjects (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--no-pin", action="store_true", help="do not pin redis-server and bench to CPUs")
    ap.add_argument("--only", default="p1,p2,p7,p9", help="comma-separated subset, e.g. p1,p9")
    args = ap.parse_args(argv)
    chosen = {x.strip().lower() for x in args.only.split(",")}
    benches: dict[str, Callable[[Server, bool], Result]] = {"p1": p1, "p2": p2, "p7": p7, "p9": p9}
    rows: list[Row] = []
    report: dict[str, Any] = {"argv": sys.argv, "quick": args.quick, "python": sys.version.split()[0],
                              "redis_py": redis.__version__, "limits": limits.__version__,
                              "geolimit": source_state()}
    with open_server(args.redis_url, pin=not args.no_pin) as server:
        report["server"] = asdict(server)
        print(f"redis {server.version} at {server.url} ({'embedded' if server.embedded else 'external'},"
              f" {server.binary}); pinning: {server.pinning}", flush=True)
        for name, bench in benches.items():
            if name in chosen:
                admin = redis.Redis.from_url(server.url)
                meter = LoadMeter(admin)
                got, report[name] = bench(server, args.quick)
                rows += got
                load = report[name]["machine_load"] = meter.stop()
                admin.close()
                print(f"[{name} done in {load['seconds']:.1f}s; CPUs busy: bench {load['bench_cpus']:.2f}, "
                      f"redis {load['redis_cpus']:.2f}, other processes {load['other_cpus']:.2f}; CPU "
                      f"calibration {load['calib_ms_start']:.1f}/{load['calib_ms_end']:.1f} ms]", flush=True)
    if "p1" in report:
        d = report["p1"]["diagnosis"]
        print("P1 hot-key breakdown, median us/op:",
              ", ".join(f"{k} {v:.1f}" for k, v in d["per_op_median_us"].items()))
        print("P1 server usec_per_call:",
              ", ".join(f"{k} {v:.2f}" for k, v in d["server_usec_per_call_median"].items()))
    for k, v in report.get("p2", {}).get("per_trial", {}).items():
        print(f"P2 {k}: decisions/call {median([x['decisions_per_call'] for x in v]):.1f}, "
              f"server usec/call {median([x['usec_per_call'] for x in v]):.1f}, server CPU "
              f"{median([x['server_cpu'] for x in v]):.0%}, bench CPU {median([x['bench_cpu'] for x in v]):.0%}")
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

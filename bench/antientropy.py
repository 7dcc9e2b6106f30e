"""Anti-entropy at scale: two regions with the same N live keys each (default 1M).

    python bench/antientropy.py [--keys 1000000] [--diff 0.01] [--page-keys 256] [--json PATH]

Starts two redis-servers (one per region, embedded), fills both with the same
keys (rule "api", 2 slots x 2 buckets per key, stored at different slot
indices in each region), then measures, with a same-run baseline:

* the pass time of one anti-entropy exchange with no differences (target: at
  most 10 s at 1M keys); baseline: a bare redis-py SCAN + pipelined HGETALL
  over the same keys of one region (what reading every live key in Python
  costs, before any digesting);
* bytes exchanged (every payload and reply msgpack-encoded, as a transport would);
* with ``--diff`` of the keys made to differ (missing keys and cells, lower
  values, in both directions), that runs repair them (target: within 2 runs)
  and that the next run finds no difference; every changed key is compared
  cell by cell by slot id afterwards;
* check latency: a separate process calls the decision script (hit.lua, one
  EVALSHA per call, alternating regions) the whole time; p50/p99 during each
  exchange against the same loop while nothing else runs (target p99 < 5 ms);
* the event-loop lag of the process running both sides of the exchange.

Repairs are applied with a plain Python max-merge (``--merge naive``, default)
or with the agent's ``ReplicationStore.merge_blobs`` (``--merge store``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import redis
import redis.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _antientropy import (
    API,
    LAYOUT,
    SLOT_A,
    SLOT_B,
    CpuMeter,
    baseline_scan,
    cells_by_slot,
    checker,
    data_key,
    fill,
    naive_merge,
    quantiles,
    registry,
)

from geolimit.replication.antientropy import AntiEntropy, AntiEntropyResult
from geolimit.replication.antientropy.common import Admit
from geolimit.store.connect import open_async_store
from geolimit.store.embedded import EmbeddedRedis

# -- the run --------------------------------------------------------------------------------


async def exchange(
    initiator: AntiEntropy, lag: list[float], label: str, meter: CpuMeter, log: Callable[[str], None]
) -> dict[str, Any]:
    before = meter.sample()
    await asyncio.sleep(0.02)  # let the lag monitor catch up with our own blocking calls
    lag.clear()
    t0 = time.time()
    result = await initiator.run("b")
    t1 = time.time()
    loop_lag = quantiles(list(lag))
    cores = meter.cores(before, meter.sample())
    log(f"{label}: {result.seconds:.2f} s, our scan {result.scan_seconds:.2f} s, {result.keys_scanned} keys, "
        f"{result.ranges_compared} ranges compared, {result.leaves_differing} leaves differ, "
        f"{result.keys_differing} keys differ, {result.keys_received} fetched / {result.keys_sent} pushed, "
        f"{result.steps} steps, truncated={result.truncated}; cores used {cores}")
    return {"result": result, "window": (t0, t1), "loop_lag": loop_lag, "cores": cores}


async def main_async(
    args: argparse.Namespace, a: EmbeddedRedis, b: EmbeddedRedis, meter: CpuMeter, report: dict[str, Any]
) -> None:
    def log(text: str) -> None:
        print(text, flush=True)

    store_a = open_async_store(a.url, timeout=5.0)
    store_b = open_async_store(b.url, timeout=5.0)
    raw_a = redis.asyncio.Redis.from_url(a.url)
    raw_b = redis.asyncio.Redis.from_url(b.url)
    traffic = {"requests": 0, "request_bytes": 0, "reply_bytes": 0}
    sides: dict[str, AntiEntropy] = {}

    async def send(peer: str, payload: dict[str, Any]) -> dict[str, Any]:
        body = msgpack.packb(payload, use_bin_type=True)
        traffic["requests"] += 1
        traffic["request_bytes"] += len(body)
        reply = await sides[peer].handle("a" if peer == "b" else "b", msgpack.unpackb(body, raw=False))
        out = msgpack.packb(reply, use_bin_type=True)
        traffic["reply_bytes"] += len(out)
        return msgpack.unpackb(out, raw=False)  # type: ignore[no-any-return]

    if args.merge == "store":
        from geolimit.replication.redis_io import ReplicationStore

        rs_a = ReplicationStore(store_a, LAYOUT, "a", {"api": API}, b"bench0", peers=["b"])
        rs_b = ReplicationStore(store_b, LAYOUT, "b", {"api": API}, b"bench1", peers=["a"])

        # (the third argument, as AntiEntropy's Merge: run between the checks and the writes)
        async def merge_a(peer: str, blobs: list[tuple[int, bytes]], admit: Admit | None = None) -> None:
            await rs_a.merge_blobs(blobs, peer, admit=admit)

        async def merge_b(peer: str, blobs: list[tuple[int, bytes]], admit: Admit | None = None) -> None:
            await rs_b.merge_blobs(blobs, peer, admit=admit)
    else:
        async def merge_a(peer: str, blobs: list[tuple[int, bytes]], admit: Admit | None = None) -> None:
            if admit is not None:
                await admit()
            await naive_merge(raw_a, blobs)

        async def merge_b(peer: str, blobs: list[tuple[int, bytes]], admit: Admit | None = None) -> None:
            if admit is not None:
                await admit()
            await naive_merge(raw_b, blobs)

    rules = {"api": API}
    opts: dict[str, Any] = {"page_keys": args.page_keys, "page_ms": args.page_ms, "streams": args.streams,
                            "duty": args.duty}
    sides["a"] = AntiEntropy("a", store_a, LAYOUT, rules, send, merge_a, **opts)
    sides["b"] = AntiEntropy("b", store_b, LAYOUT, rules, send, merge_b, **opts)

    lag: list[float] = []
    running = True

    async def monitor() -> None:
        while running:
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            lag.append(time.perf_counter() - t - 0.002)

    mon = asyncio.ensure_future(monitor())

    async def timed(label: str) -> dict[str, Any]:
        before = dict(traffic)
        phase = await exchange(sides["a"], lag, label, meter, log)
        phase["traffic"] = {k: traffic[k] - before[k] for k in traffic}
        return phase

    phases: dict[str, Any] = {"no_diff": [await timed(f"no-diff run {n + 1}") for n in range(args.repeat)]}
    if not args.quick:
        # Make --diff of the keys differ, in both directions. Only copies of the
        # other region's slot are lowered: a region's own slot only grows, and the
        # agent's merge refuses a peer claiming more in it than it counted.
        rng = random.Random(7)
        changed = rng.sample(range(args.keys), max(5, int(args.keys * args.diff)))
        sync_a, sync_b = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
        pa, pb = sync_a.pipeline(transaction=False), sync_b.pipeline(transaction=False)
        c, m = report["bucket"], API.ring
        kinds = dict.fromkeys(("b_missing_key", "a_missing_key", "b_missing_cell", "b_lower_value",
                               "a_lower_value", "a_missing_cell"), 0)
        for n, i in enumerate(changed):
            key = data_key(i)
            kind = list(kinds)[n % len(kinds)]
            kinds[kind] += 1
            if kind == "b_missing_key":  # a subject only region a counted: b never heard of it
                pa.hdel(key, 1 * m + c % m, 1 * m + (c - 2) % m)  # a keeps only its own cells
                pb.delete(key)
            elif kind == "a_missing_key":
                pb.hdel(key, 1 * m + c % m, 1 * m + (c - 1) % m)
                pa.delete(key)
            elif kind == "b_missing_cell":
                pb.hdel(key, 1 * m + (c - 1) % m)  # slot a (index 1 in b), bucket c-1
            elif kind == "b_lower_value":
                pb.hset(key, 1 * m + c % m, 1)  # slot a (index 1 in b), bucket c
            elif kind == "a_lower_value":
                pa.hset(key, 1 * m + c % m, 1)  # slot b (index 1 in a), bucket c
            else:
                pa.hdel(key, 1 * m + (c - 2) % m)  # slot b (index 1 in a), bucket c-2
        pa.execute()
        pb.execute()
        log(f"made {len(changed)} keys differ: {kinds}")
        runs = []
        for n in range(1, 4):
            runs.append(await timed(f"repair run {n}"))
            if runs[-1]["result"].in_sync:
                break
        phases["repair"] = runs
        now_us = int(time.time() * 1e6)
        unequal = [i for i in changed if cells_by_slot(sync_a, i, now_us) != cells_by_slot(sync_b, i, now_us)]
        sample = rng.sample(range(args.keys), 2000)
        unequal_sample = [i for i in sample if cells_by_slot(sync_a, i, now_us) != cells_by_slot(sync_b, i, now_us)]
        phases["verify"] = {"changed_keys": len(changed), "changed_keys_unequal": len(unequal),
                            "random_keys_checked": len(sample), "random_keys_unequal": len(unequal_sample),
                            "kinds": kinds}
        sync_a.close()
        sync_b.close()
    running = False
    await mon
    for side in sides.values():
        await side.close()
    for st in (store_a, store_b):
        await st.close()
    await raw_a.aclose()
    await raw_b.aclose()
    report["phases"] = phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--diff", type=float, default=0.01, help="fraction of keys made to differ")
    parser.add_argument("--page-keys", type=int, default=256, help="keys per script call, at most")
    parser.add_argument("--page-ms", type=float, default=1.0, help="milliseconds per script call, about")
    parser.add_argument("--streams", type=int, default=1, help="SCAN streams per region")
    parser.add_argument("--duty", type=float, default=1.0, help="share of a Redis's time for anti-entropy")
    parser.add_argument("--repeat", type=int, default=3, help="exchanges without differences")
    parser.add_argument("--quick", action="store_true", help="only the exchanges without differences")
    parser.add_argument("--check-rate", type=float, default=500.0, help="decision calls per second")
    parser.add_argument("--merge", choices=("naive", "store"), default="naive")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    report: dict[str, Any] = {"keys": args.keys, "cpus": os.cpu_count(), "page_keys": args.page_keys}
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        ca, cb = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
        c = int(time.time() * 1e6) // API.resolution_us
        report["bucket"] = c
        registry(ca, SLOT_A, SLOT_B)
        registry(cb, SLOT_B, SLOT_A)
        fa = fill(ca, args.keys, c, 0)
        fb = fill(cb, args.keys, c, 1)
        print(f"filled {args.keys} keys per region in {fa:.1f} s + {fb:.1f} s "
              f"({ca.info('memory')['used_memory_human']} per region)", flush=True)
        meter = CpuMeter([ca, cb], None)
        before = meter.sample()
        base_s, base_n = baseline_scan(ca)
        base_cores = meter.cores(before, meter.sample())
        print(f"baseline: redis-py SCAN + pipelined HGETALL of {base_n} keys of one region: {base_s:.2f} s; "
              f"cores used {base_cores}", flush=True)
        report["baseline"] = {"seconds": base_s, "keys": base_n, "cores": base_cores}

        stop = mp.Event()
        recv, send = mp.Pipe(duplex=False)
        proc = mp.Process(target=checker, args=([a.url, b.url], stop, send, args.check_rate), daemon=True)
        proc.start()
        meter.checker_pid = proc.pid
        before = meter.sample()
        idle_start = time.time()
        time.sleep(4.0)  # the decision loop alone: its same-run baseline
        idle_end = time.time()
        idle_cores = meter.cores(before, meter.sample())
        asyncio.run(main_async(args, a, b, meter, report))
        stop.set()
        samples: list[tuple[float, float]] = recv.recv()
        proc.join(10)
        ca.close()
        cb.close()

    def during(window: tuple[float, float]) -> dict[str, float]:
        return quantiles([dt for t, dt in samples if window[0] <= t <= window[1]])

    phases = report["phases"]
    idle_q = during((idle_start + 0.5, idle_end))
    print()
    print(f"keys per region: {args.keys}; cpus: {os.cpu_count()}; page_keys: {args.page_keys}; "
          f"page_ms: {args.page_ms}; streams: {args.streams}; duty: {args.duty}")
    print(f"baseline (bare redis-py SCAN+HGETALL, one region): {report['baseline']['seconds']:.2f} s")
    print(f"decision loop alone: p50 {idle_q.get('p50_ms', 0):.2f} ms, p99 {idle_q.get('p99_ms', 0):.2f} ms "
          f"(n={idle_q['n']}); cores used {idle_cores}")

    def row(label: str, phase: dict[str, Any]) -> dict[str, Any]:
        res: AntiEntropyResult = phase["result"]
        q = during(phase["window"])
        tr = phase["traffic"]
        print(f"{label}: {res.seconds:.2f} s, bytes {tr['request_bytes'] + tr['reply_bytes']:,} in "
              f"{tr['requests']} requests, leaves differing {res.leaves_differing}, keys differing "
              f"{res.keys_differing}, check p50 {q.get('p50_ms', 0):.2f} ms p99 {q.get('p99_ms', 0):.2f} ms "
              f"max {q.get('max_ms', 0):.1f} ms (n={q['n']}), loop lag p99 {phase['loop_lag'].get('p99_ms', 0):.1f} ms "
              f"max {phase['loop_lag'].get('max_ms', 0):.1f} ms, cores {phase['cores']}")
        return {"result": {k: getattr(res, k) for k in res.__slots__},
                "traffic": tr, "check": q, "loop_lag": phase["loop_lag"], "cores": phase["cores"]}

    out: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "baseline": report["baseline"],
                           "check_alone": idle_q, "check_alone_cores": idle_cores}
    out["no_diff"] = [row(f"no-diff run {n + 1}", p) for n, p in enumerate(phases["no_diff"])]
    out["repair"] = [row(f"repair run {n + 1}", p) for n, p in enumerate(phases.get("repair", []))]
    out["verify"] = phases.get("verify")
    if out["verify"]:
        print(f"verify: {out['verify']}")
    times = sorted(p["result"].seconds for p in phases["no_diff"])
    median_s = statistics.median(times)
    runs = phases.get("repair", [])
    repaired_by = next((n for n, p in enumerate(runs) if p["result"].in_sync), None)
    checks = [r["check"] for r in out["no_diff"]] + [r["check"] for r in out["repair"]]
    worst_p99 = max(q.get("p99_ms", 0.0) for q in checks)
    verdicts = {f"no-diff exchange <= 10 s (median of {len(times)}: {median_s:.2f} s)": median_s <= 10.0}
    if runs:
        verdicts[f"repaired within 2 runs (in sync at run {repaired_by + 1 if repaired_by is not None else '-'})"] = (
            repaired_by is not None and repaired_by <= 2
            and out["verify"]["changed_keys_unequal"] == 0 and out["verify"]["random_keys_unequal"] == 0
        )
    verdicts[f"check p99 < 5 ms during every exchange (worst {worst_p99:.2f} ms)"] = worst_p99 < 5.0
    for what, ok in verdicts.items():
        print(f"{'PASS' if ok else 'MISS'}  {what}")
    out["verdicts"] = verdicts
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()

"""bench/antientropy.py's fixture: its keys written in Redis, the baseline scan, the decision
loop that runs beside the exchanges, a plain max-merge and the CPU meter."""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit import Limiter, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import read_key
from geolimit.replication.redis_io import unpack_blob

API = Rule("api", 10**6, 600, 60)  # N = 10, F = 1, M = 12: keys stay live for minutes
CHECK = Rule("chk", 10**9, 10, 1)  # the decision loop's rule (not compared by anti-entropy)
LAYOUT = KeyLayout("gl", 64)
SLOT_A, SLOT_B = b"a/i1", b"b/i2"

# Writes the bench's keys: per key, slot a in buckets c and c-1, slot b in c and c-2.
FILL = """
local c, M, ia, ttl, base = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local ib = 1 - ia
for j = 6, #ARGV do
  local i = base + j - 6
  local key = ARGV[j]
  redis.call('HSET', key, 'h', c,
    ia * M + c % M, 64 * (1 + i % 89) + i % 64, ia * M + (c - 1) % M, 64 * (1 + i % 53),
    ib * M + c % M, 64 * (1 + i % 31) + 7, ib * M + (c - 2) % M, 64 * (2 + i % 17))
  redis.call('PEXPIRE', key, ttl)
end
return #ARGV - 5
"""


def subject(i: int) -> bytes:
    return b"user:%d" % i


def data_key(i: int) -> bytes:
    return LAYOUT.data_key("api", subject(i))


def registry(client: redis.Redis, own: bytes, other: bytes) -> None:
    pipe = client.pipeline(transaction=False)
    for s in range(LAYOUT.shards):
        pipe.hset(LAYOUT.registry_key(s), mapping={"@": own.split(b"/")[1], "#": 2, own: 0, other: 1})
    pipe.execute()


def fill(client: redis.Redis, keys: int, c: int, own_index_of_a: int) -> float:
    started = time.perf_counter()
    script = client.register_script(FILL)
    batch = 5000
    for lo in range(0, keys, batch):
        names = [data_key(i) for i in range(lo, min(keys, lo + batch))]
        script(args=[c, API.ring, own_index_of_a, 15 * 60 * 1000, lo, *names])
    return time.perf_counter() - started


def baseline_scan(client: redis.Redis) -> tuple[float, int]:
    """Bare redis-py: SCAN every data key, HGETALL them pipelined 1000 at a time."""
    started = time.perf_counter()
    n = 0
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal n
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.hgetall(key)
        n += sum(1 for fields in pipe.execute() if fields)
        batch.clear()

    for key in client.scan_iter(match=b"gl:{*}:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            flush()
    if batch:
        flush()
    return time.perf_counter() - started, n


# -- the decision loop (a separate process: an app) ------------------------------------


def checker(urls: list[str], stop: Any, out: Any, rate: float) -> None:
    """Decision calls at random (Poisson) times, alternating regions; records (time, latency)."""
    limiters = [Limiter.from_url(u, region, [CHECK]) for u, region in zip(urls, ("a", "b"), strict=True)]
    rng = random.Random(1)
    samples: list[tuple[float, float]] = []
    i = 0
    while not stop.is_set():
        time.sleep(rng.expovariate(rate))
        lim = limiters[i % 2]
        i += 1
        t0 = time.perf_counter()
        lim.hit("chk", b"s%d" % rng.randrange(1000))
        t1 = time.perf_counter()
        samples.append((time.time(), t1 - t0))
    out.send(samples)


def quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"n": len(s), "p50_ms": statistics.median(s) * 1e3, "p99_ms": pick(0.99) * 1e3, "max_ms": s[-1] * 1e3}


# -- repairs: a plain Python max-merge (or the agent's merge_blobs) ------------------------


async def naive_merge(client: redis.asyncio.Redis, blobs: list[tuple[int, bytes]]) -> None:
    """Max-merge blob cells (bench helper; the agent uses ReplicationStore.merge_blobs)."""
    rules = {API.name: API}
    for shard, blob in blobs:
        slots, keys = unpack_blob(blob)
        reg = LAYOUT.registry_key(shard)
        known = await client.hgetall(reg)
        index = {}
        for sid in slots:
            if sid not in known:
                n = await client.hincrby(reg, "#", 1) - 1
                await client.hset(reg, sid, n)
                known[sid] = b"%d" % n
            index[sid] = int(known[sid])
        for suffix, cells in keys:
            rule = rules[suffix.partition(b":")[0].decode()]
            key = LAYOUT.tag(shard) + b":" + suffix
            fields = await client.hgetall(key)
            head = int(fields[b"h"]) if b"h" in fields else None
            writes: dict[bytes, int] = {}
            top = max(cells[0::4])
            if head is None or top > head:
                if head is not None and top - head < rule.ring:
                    for b in range(head + 1, top + 1):
                        for f in list(fields):
                            if f not in (b"h", b"e"):  # the head and the expiry mark
                                v = int(f)
                                base = -v - 1 if v < 0 else v
                                if base % rule.ring == b % rule.ring:
                                    del fields[f]
                                    await client.hdel(key, f)
                elif head is not None:
                    await client.delete(key)
                    fields = {}
                head = top
                writes[b"h"] = head
            for j in range(0, len(cells), 4):
                b, ref, value, floor = cells[j : j + 4]
                if b <= head - rule.ring:
                    continue
                f = index[slots[ref]] * rule.ring + b % rule.ring
                for name, new in ((b"%d" % f, value), (b"%d" % (-f - 1), floor)):
                    if new > int(fields.get(name, 0)) and new > writes.get(name, 0):
                        writes[name] = new
            if writes:
                await client.hset(key, mapping=writes)  # type: ignore[arg-type]
                await client.pexpire(key, rule.ttl_ms)


def cells_by_slot(client: redis.Redis, i: int, now_us: int) -> dict[tuple[str, int], tuple[int, int]]:
    key = data_key(i)
    shard = LAYOUT.shard_of(subject(i))
    registry: dict[bytes, bytes] = client.hgetall(LAYOUT.registry_key(shard))  # type: ignore[assignment]
    names = {int(v): k.decode() for k, v in registry.items() if b"/" in k}
    fields: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]
    view = read_key(fields, now_us // API.resolution_us, API.buckets, API.ring)
    return {(names[s], b): cell for (s, b), cell in view.cells.items() if cell != (0, 0)}


# -- CPU accounting (the machine is shared: say how busy it was with other work) ----------


class CpuMeter:
    """CPU seconds of the machine, this process, both redis-servers and the decision loop."""

    def __init__(self, clients: list[redis.Redis], checker_pid: int | None) -> None:
        self.clients = clients
        self.checker_pid = checker_pid

    def sample(self) -> dict[str, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick
        own = os.times()
        redis_cpu = 0.0
        for client in self.clients:
            info: dict[str, Any] = client.info("cpu")
            redis_cpu += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        checker_cpu = 0.0
        if self.checker_pid is not None:
            try:
                with open(f"/proc/{self.checker_pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                checker_cpu = (int(parts[11]) + int(parts[12])) / tick
            except OSError:
                pass
        return {"wall": time.monotonic(), "machine": busy, "agents": own.user + own.system,
                "redis": redis_cpu, "check": checker_cpu}

    @staticmethod
    def cores(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """Average cores used between two samples, by whom; "other": the rest of the machine."""
        wall = after["wall"] - before["wall"]
        used = {k: (after[k] - before[k]) / wall for k in ("machine", "agents", "redis", "check")}
        used["other"] = max(0.0, used["machine"] - used["agents"] - used["redis"] - used["check"])
        return {k: round(v, 2) for k, v in used.items()}

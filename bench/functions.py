"""Sync Limiter.hit on Redis 7: the script library by FCALL vs the same scripts by EVALSHA.

    python bench/functions.py [--redis-server PATH] [--rounds N] [--chunk N] [--rules N]

Starts one loopback redis-server (default /usr/bin/redis-server, Debian's Redis 7; must
be >= 7) and two limiters on it with the same rules: one whose store calls the function
library (FCALL), one held to EVALSHA (its store's ``functions`` set to False). Rounds
alternate between the two (a chunk of hits each), so both see the same machine load.
Prints per-call client latency (median over rounds) and the server's own time per call
(INFO commandstats usec_per_call of FCALL and EVALSHA), each with the ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import redis
from _common import Row, commandstats, median, paired_ratio, print_table

from geolimit import Limiter, Rule
from geolimit.store.embedded import ENV_SERVER, EmbeddedRedis
from geolimit.store.redis_store import RedisStore

HUGE = 10**12  # every hit is allowed, so every hit takes the writing path


def limiter(url: str, prefix: str, functions: bool, nrules: int) -> Limiter:
    rules = [Rule(f"r{i}", HUGE, 60) for i in range(nrules)]
    lim = Limiter.from_url(url, region="us-east", rules=rules, prefix=prefix)
    store = lim.store
    assert isinstance(store, RedisStore)
    if functions:
        assert store.load_functions(), "this server refused FUNCTION LOAD"
    else:
        store.functions = False
    return lim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-server", default="/usr/bin/redis-server")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=100)
    parser.add_argument("--rules", type=int, default=1, help="rules per hit")
    opts = parser.parse_args()
    os.environ[ENV_SERVER] = opts.redis_server
    server = EmbeddedRedis().start()
    try:
        if int(server.version.split(".")[0]) < 7:
            raise SystemExit(f"redis-server {server.version} has no FUNCTION: give a Redis >= 7")
        print(f"redis-server {server.version} ({opts.redis_server}), {opts.rounds} rounds x {opts.chunk} hits, "
              f"{opts.rules} rule(s) per hit")
        names = [f"r{i}" for i in range(opts.rules)]
        by_fcall = limiter(server.url, "bf", True, opts.rules)
        by_sha = limiter(server.url, "be", False, opts.rules)
        admin = redis.Redis.from_url(server.url)
        for lim in (by_fcall, by_sha):  # warm up: connections, registries, script cache
            for i in range(200):
                lim.hit(names, f"s{i % 10}")
        admin.config_resetstat()
        fcall_us: list[float] = []
        sha_us: list[float] = []
        for round_ in range(opts.rounds):
            pair = [(by_fcall, fcall_us), (by_sha, sha_us)]
            for lim, out in pair if round_ % 2 == 0 else pair[::-1]:
                start = time.perf_counter()
                for i in range(opts.chunk):
                    lim.hit(names, f"s{i % 10}")
                out.append((time.perf_counter() - start) / opts.chunk * 1e6)
        stats = commandstats(admin)
        server_fcall = float(stats["fcall"]["usec_per_call"])
        server_sha = float(stats["evalsha"]["usec_per_call"])
        rows = [
            Row("hit latency, FCALL", f"{median(fcall_us):.1f} us", f"EVALSHA {median(sha_us):.1f} us",
                f"{paired_ratio(fcall_us, sha_us):.2f}x", "< 1x", "-"),
            Row("server time per call, FCALL", f"{server_fcall:.2f} us", f"EVALSHA {server_sha:.2f} us",
                f"{server_fcall / server_sha:.2f}x", "< 1x", "-"),
        ]
        for row in rows:
            row.verdict = "PASS" if float(row.ratio.rstrip("x")) < 1 else "MISS"
        print_table(rows)
        print(f"server time saved per call: {server_sha - server_fcall:.2f} us "
              f"(calls: fcall {int(stats['fcall']['calls'])}, evalsha {int(stats['evalsha']['calls'])})")
        admin.close()
        by_fcall.close()
        by_sha.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()

"""The async store's pipelined script calls against a real Redis."""

from __future__ import annotations

import hashlib
import time

from geolimit.store.connect import open_async_store
from geolimit.store.scripts import LuaScript

# Keeps Redis busy for ARGV[1] loop iterations, then answers ARGV[2].
BUSY = b"local x = 0 for i = 1, tonumber(ARGV[1]) do x = x + i end return ARGV[2]"
SCRIPT = LuaScript("busy", BUSY, hashlib.sha1(BUSY).hexdigest().encode())
CALLS = 80


async def test_long_pipelines_stay_within_the_socket_timeout(redis_url: str) -> None:
    """Redis answers a pipelined batch only after running all of it: 80 calls of
    ~20 ms in one trip would exceed a 1 s timeout, so run_many sends small groups
    (8 calls, ~160 ms: room for the noisy machine to run them 6x slower)."""
    store = open_async_store(redis_url, timeout=1.0)
    try:
        probe = 1_000_000
        await store.run(SCRIPT, [b"0", b"1", b"x"])  # loads the script
        started = time.monotonic()
        await store.run(SCRIPT, [b"0", b"%d" % probe, b"x"])
        loops = int(probe * 0.02 / max(1e-4, time.monotonic() - started))  # about 20 ms per call
        took = 0.0
        for _ in range(4):  # the machine is noisy: grow the calls until they add up to > 1.2 s
            started = time.monotonic()
            replies = await store.run_many(SCRIPT, [[b"0", b"%d" % loops, b"%d" % i] for i in range(CALLS)])
            took = time.monotonic() - started
            assert replies == [b"%d" % i for i in range(CALLS)]
            if took > 1.2:
                break
            loops = int(loops * 1.5 / took)
    finally:
        await store.close()
    assert took > 1.2, f"the calls took only {took:.2f}s in total: the test did not exceed the timeout"

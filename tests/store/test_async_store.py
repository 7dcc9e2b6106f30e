"""The async store's pipelined script calls against a real Redis."""

from __future__ import annotations

import hashlib
import secrets
import time

import pytest
import redis
from redis._parsers.hiredis import _AsyncHiredisParser

from geolimit.errors import StorageError
from geolimit.store.connect import open_async_store
from geolimit.store.scripts import LuaScript

# Keeps Redis busy for ARGV[1] loop iterations, then answers ARGV[2].
BUSY = b"local x = 0 for i = 1, tonumber(ARGV[1]) do x = x + i end return ARGV[2]"
SCRIPT = LuaScript("busy", BUSY, hashlib.sha1(BUSY).hexdigest().encode())
CALLS = 80
FAILS = b"return redis.error_reply('ERR deliberately')"
FAILING = LuaScript("fails", FAILS, hashlib.sha1(FAILS).hexdigest().encode())


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


async def test_a_script_call_that_times_out_drops_its_connection(redis_url: str) -> None:
    """The reply of a call that timed out never answers the next call: its connection is closed."""
    store = open_async_store(redis_url, timeout=0.3)
    try:
        assert await store.run(SCRIPT, [b"0", b"1", b"first"]) == b"first"
        assert isinstance(store._free[0]._parser, _AsyncHiredisParser)  # read by _exchange
        loops, error = 1, ""
        for _ in range(30):  # grow the loop until one call outlasts the timeout
            try:
                await store.run(SCRIPT, [b"0", b"%d" % loops, b"late"])
            except StorageError as exc:
                error = str(exc)
                break
            loops *= 2
        assert "Redis unreachable: TimeoutError" in error
        for attempt in range(20):  # Redis may still be running the late call
            try:
                assert await store.run(SCRIPT, [b"0", b"1", b"next %d" % attempt]) == b"next %d" % attempt
                break
            except StorageError:
                continue
    finally:
        await store.close()


async def test_script_calls_go_on_after_the_server_closes_the_connection(redis_url: str) -> None:
    name = "gl-test-" + secrets.token_hex(4)
    store = open_async_store(redis_url, timeout=1.0, client_name=name)
    admin = redis.Redis.from_url(redis_url)
    try:
        assert await store.run(SCRIPT, [b"0", b"1", b"one"]) == b"one"
        killed = [admin.client_kill_filter(_id=c["id"]) for c in admin.client_list() if c["name"] == name]
        assert killed == [1]
        assert await store.run(SCRIPT, [b"0", b"1", b"two"]) == b"two"  # on a new connection
        with pytest.raises(StorageError, match="Redis error: ResponseError"):
            await store.run(FAILING, [b"0"])
        assert await store.run(SCRIPT, [b"0", b"1", b"three"]) == b"three"  # the same connection, still in step
        assert len([c for c in admin.client_list() if c["name"] == name]) == 1
        admin.script_flush()
        assert await store.run(SCRIPT, [b"0", b"1", b"four"]) == b"four"  # NOSCRIPT: loaded again
    finally:
        admin.close()
        await store.close()

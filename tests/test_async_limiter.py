"""The AsyncLimiter against a real Redis and a real cluster, with automatic pipelining."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from geolimit import AsyncLimiter, ManualClock, RequestError, Rule, UnknownRuleError

MakeAsync = Callable[..., AsyncLimiter]


async def test_fifty_tasks_race_for_ten_slots(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("api", 10, 10)])
    results = await asyncio.gather(*(limiter.hit("api", "user:42") for _ in range(50)))
    assert sum(d.allowed for d in results) == 10
    assert sorted(d.remaining for d in results if d.allowed) == list(range(10))


async def test_concurrent_calls_share_round_trips(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("api", 1000, 10)], max_batch=64)
    calls = 0
    original = limiter.store.run_resp if hasattr(limiter.store, "run_resp") else limiter.store.run

    async def counting(*args: object) -> object:
        nonlocal calls
        calls += 1
        return await original(*args)  # type: ignore[operator]

    name = "run_resp" if hasattr(limiter.store, "run_resp") else "run"
    setattr(limiter.store, name, counting)
    # One subject, so on a cluster too every batch is a single hash slot.
    decisions = await asyncio.gather(*(limiter.hit("api", "user:1") for _ in range(256)))
    assert all(d.allowed for d in decisions)
    assert sorted(d.remaining for d in decisions) == list(range(1000 - 256, 1000))
    assert calls < 256 / 4, f"{calls} script calls for 256 concurrent decisions"


async def test_multi_rule_atomicity_and_weighted_cost(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("burst", 4, 1), Rule("daily", 100, 86400, 3600)])
    assert (await limiter.hit(["burst", "daily"], "k", cost=3)).allowed
    denied = await limiter.hit(["burst", "daily"], "k", cost=2)
    assert not denied.allowed
    assert denied.rule == "burst"
    assert (await limiter.usage("daily", "k")).total == 3
    assert (await limiter.hit(["burst", "daily"], "k", cost=1)).remaining == 0


async def test_retry_after_is_exact(make_async_limiter: MakeAsync) -> None:
    clock = ManualClock(1_700_000_000.3)
    limiter = make_async_limiter([Rule("api", 2, 1, 0.1)], clock=clock)
    assert (await limiter.hit("api", "k")).allowed
    clock.advance(0.45)
    assert (await limiter.hit("api", "k")).allowed
    denied = await limiter.hit("api", "k")
    wait_us = round(denied.retry_after * 1_000_000)
    clock.advance_us(wait_us - 1)
    assert not (await limiter.peek("api", "k")).allowed
    clock.advance_us(1)
    assert (await limiter.hit("api", "k")).allowed


async def test_peek_reset_and_usage(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("api", 3, 10)])
    await limiter.hit_many([("api", "k", 1), ("api", "k", 1)])
    assert (await limiter.peek("api", "k")).remaining == 1
    usage = await limiter.usage("api", "k")
    assert usage.total == 2
    assert usage.by_region == {"east": 2}
    await limiter.reset("api", "k")
    assert (await limiter.peek("api", "k")).remaining == 3


async def test_bad_input_fails_only_the_bad_call(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("api", 3, 10)])
    with pytest.raises(UnknownRuleError):
        await limiter.hit("nope", "k")
    with pytest.raises(RequestError):
        await limiter.hit("api", "k", cost=-5)
    good = await asyncio.gather(limiter.hit("api", "k"), limiter.hit("api", "k"))
    assert [d.remaining for d in sorted(good, key=lambda d: -d.remaining)] == [2, 1]


async def test_a_cancelled_caller_does_not_break_the_limiter(make_async_limiter: MakeAsync) -> None:
    limiter = make_async_limiter([Rule("api", 100, 10)])
    tasks = [asyncio.ensure_future(limiter.hit("api", "k")) for _ in range(20)]
    tasks[3].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert (await limiter.hit("api", "k")).allowed

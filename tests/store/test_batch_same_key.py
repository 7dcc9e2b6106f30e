"""A batch that decides one subject several times answers and stores what the same requests make one call each.

``hit.lua`` keeps what it read of a key (the registry's HMGET, a data key's HGETALL) for the batch's
next request of that key, with its own writes applied: the same requests, coalesced into one call for
one subject, must get the decisions that one call per request gives another subject at the same
times, and leave the same fields in the same order.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import AsyncLimiter, ManualClock, Rule

RULES = [
    Rule("fast", 5, 1, 0.1),
    Rule("slow", 12, 10, 1),
    Rule("approx", 8, 4, 1, mode="approximate"),
]

request = st.tuples(
    st.lists(st.sampled_from(RULES), min_size=1, max_size=3, unique_by=lambda r: r.name),
    st.integers(0, 4),
    st.booleans(),  # consume (hit) or not (peek)
)
gaps = st.one_of(st.integers(0, 60_000), st.integers(0, 1_200_000), st.integers(0, 12_000_000))
batches = st.lists(st.tuples(gaps, st.lists(request, min_size=1, max_size=12)), min_size=1, max_size=8)


@pytest.fixture
async def limiters(redis_url: str) -> AsyncIterator[tuple[AsyncLimiter, AsyncLimiter, ManualClock]]:
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()  # another test's region on this shared Redis would be refused
    clock = ManualClock(1_700_000_000.0)
    batched = AsyncLimiter.from_url(redis_url, region="east", rules=RULES, clock=clock, max_in_flight=1)
    single = AsyncLimiter.from_url(redis_url, region="east", rules=RULES, clock=clock)
    yield batched, single, clock
    await batched.aclose()
    await single.aclose()


def _fields(client: redis.Redis, key: bytes) -> list[tuple[bytes, bytes]]:
    """The key's fields in Redis's order, without the expiry mark (it follows Redis's own clock)."""
    flat: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]
    return [(f, v) for f, v in flat.items() if f != b"e"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches)
async def test_a_batch_for_one_subject_decides_as_one_call_per_request(
    limiters: tuple[AsyncLimiter, AsyncLimiter, ManualClock], redis_url: str,
    script: list[tuple[int, list[tuple[list[Rule], int, bool]]]],
) -> None:
    batched, single, clock = limiters
    a, b = secrets.token_bytes(8), secrets.token_bytes(8)
    calls = 0
    run_resp = batched.store.run_resp  # type: ignore[attr-defined]

    async def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return await run_resp(*args)

    batched.store.run_resp = counted  # type: ignore[attr-defined]
    try:
        for gap, requests in script:
            clock.advance_us(gap)
            before = calls
            got = await asyncio.gather(*(
                (batched.hit if consume else batched.peek)([r.name for r in rules], a, cost)
                for rules, cost, consume in requests))
            assert calls == before + 1  # one batch
            for (rules, cost, consume), decision in zip(requests, got, strict=True):
                names = [r.name for r in rules]
                want = await (single.hit if consume else single.peek)(names, b, cost)
                assert decision.allowed == want.allowed, (names, cost, consume)
                assert [(r.rule, r.allowed, r.limit, r.remaining, r.retry_after, r.reset_after, r.stable_for)
                        for r in decision.results] == [
                    (r.rule, r.allowed, r.limit, r.remaining, r.retry_after, r.reset_after, r.stable_for)
                    for r in want.results], (names, cost, consume)
    finally:
        batched.store.run_resp = run_resp  # type: ignore[attr-defined]
    layout = batched._layout
    with redis.Redis.from_url(redis_url) as client:
        for rule in RULES:
            assert _fields(client, layout.data_key(rule.name, a)) == _fields(client, layout.data_key(rule.name, b))

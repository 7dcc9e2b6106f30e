"""Numbers in Redis are exact integers, and reading a hash never crashes on anything else.

Lua numbers are doubles: passed straight to ``redis.call`` they are formatted
with ``%.17g`` (``1e+17``, ``4.6116860184273879e+18``), and Redis 7.2.0-7.2.4
even wrote round ones as ``6.4e+09``. The scripts format every number they write
with ``%d``; these tests read the raw hashes back.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import cast

import pytest
import redis

from geolimit import AsyncLimiter, Limiter, ManualClock, Rule
from geolimit.core.keys import KeyLayout
from geolimit.core.window import MAX_COUNT, SUBSTEPS, field_of

INTEGER = re.compile(rb"^-?[0-9]+$")
T0 = 1_700_000_000.0  # a round second: the offset within a 1 s bucket is 0, so values are round too


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def prefix() -> str:
    return "n" + secrets.token_hex(4)


def all_integers(client: redis.Redis, key: bytes, numeric_names: bool = True) -> dict[bytes, bytes]:
    """The hash at ``key`` without its expiry mark ``e`` and low mark ``l``, after checking that
    every value (and field name but ``h``, ``e`` and ``l``) is an integer."""
    fields = cast("dict[bytes, bytes]", client.hgetall(key))
    assert fields, f"{key!r} is empty"
    for name, value in fields.items():
        assert INTEGER.match(value), f"{key!r}: field {name!r} holds {value!r}"
        assert not numeric_names or name in (b"h", b"e", b"l") or INTEGER.match(name), f"{key!r}: field name {name!r}"
    return {name: value for name, value in fields.items() if not numeric_names or name not in (b"e", b"l")}


def track_changes(client: redis.Redis, layout: KeyLayout, subject: bytes) -> bytes:
    """Give the shard an agent lease far in the future, so hits and resets record changes."""
    shard = layout.shard_of(subject)
    client.hset(layout.registry_key(shard), "a", b"%d" % 10**22)
    _, changed, _ = layout.aux_keys(shard)
    return changed


def test_large_and_round_counts_are_stored_as_integers(redis_url: str, raw: redis.Redis, prefix: str) -> None:
    rules = [Rule("big", MAX_COUNT, 10, 1), Rule("round", MAX_COUNT, 10, 1)]
    clock = ManualClock(T0)
    subject = b"user:1"
    with Limiter.from_url(redis_url, region="east", rules=rules, clock=clock, prefix=prefix) as limiter:
        layout = limiter.layout
        changed = track_changes(raw, layout, subject)
        assert limiter.hit("big", subject, 2**45).allowed
        assert limiter.hit("big", subject, 2**45).allowed
        assert not limiter.hit("big", subject, 1).allowed
        assert limiter.hit("round", subject, 100_000_000).allowed
        big, rnd = layout.data_key("big", subject), layout.data_key("round", subject)
        bucket = int(T0)  # 1 s buckets
        position = b"%d" % field_of(0, bucket, rules[0].ring)
        assert all_integers(raw, big) == {b"h": b"1700000000", position: b"%d" % (2**46 * SUBSTEPS)}
        assert all_integers(raw, rnd) == {b"h": b"1700000000", position: b"%d" % (100_000_000 * SUBSTEPS)}
        assert all_integers(raw, changed, numeric_names=False) == {big: b"1700000000", rnd: b"1700000000"}
        assert limiter.usage("big", subject).total == MAX_COUNT
        assert limiter.usage("round", subject).total == 100_000_000

        limiter.reset(["big", "round"], subject)
        floor = b"%d" % (-field_of(0, bucket, rules[0].ring) - 1)
        assert all_integers(raw, big)[floor] == b"%d" % (2**46 * SUBSTEPS)
        assert all_integers(raw, rnd)[floor] == b"%d" % (100_000_000 * SUBSTEPS)
        assert all_integers(raw, changed, numeric_names=False) == {big: b"-1", rnd: b"-1"}
        assert limiter.usage("big", subject).total == 0
        # Hits after a reset add to the same cell (its floor hides what came before).
        assert limiter.hit("big", subject, 2**45).allowed
        assert all_integers(raw, big)[position] == b"%d" % ((2**46 + 2**45) * SUBSTEPS)
        assert limiter.usage("big", subject).total == 2**45


def test_numbers_past_17_digits_are_written_exactly(redis_url: str, raw: redis.Redis, prefix: str) -> None:
    """``%.17g`` turns bucket 10**17 into ``1e+17`` on every Redis version: the head,
    the changed set and values past 17 digits must still be plain integers."""
    rule = Rule("far", 10, 0.01, 0.001)
    clock = ManualClock()
    clock.set_us(10**17 * rule.resolution_us)  # bucket 10**17
    subject = b"user:2"
    with Limiter.from_url(redis_url, region="east", rules=[rule], clock=clock, prefix=prefix) as limiter:
        layout = limiter.layout
        changed = track_changes(raw, layout, subject)
        key = layout.data_key("far", subject)
        assert limiter.hit("far", subject).allowed
        position = field_of(0, 10**17, rule.ring)
        assert all_integers(raw, key) == {b"h": b"100000000000000000", b"%d" % position: b"%d" % SUBSTEPS}
        assert all_integers(raw, changed, numeric_names=False) == {key: b"100000000000000000"}
        # A reset cell whose value is past 17 digits (written by hand): the hit
        # writes value + SUBSTEPS and the reset its floor, both exactly.
        huge = 10**17  # a multiple of SUBSTEPS and exact in a double
        raw.hset(key, mapping={b"%d" % position: huge, b"%d" % (-position - 1): huge})
        assert limiter.hit("far", subject).allowed
        assert all_integers(raw, key)[b"%d" % position] == b"%d" % (huge + SUBSTEPS)
        limiter.reset("far", subject)
        assert all_integers(raw, key)[b"%d" % (-position - 1)] == b"%d" % (huge + SUBSTEPS)


def _write_bad_key(client: redis.Redis, layout: KeyLayout, rule: Rule, subject: bytes, now_us: int) -> None:
    """A key holding good cells (3 own units, 2 from 'west') among values Python cannot take as counts."""
    bucket = now_us // rule.resolution_us
    shard = layout.shard_of(subject)
    ring = rule.ring
    client.hset(
        layout.registry_key(shard),
        mapping={"@": "abc", "#": 5, "east/abc": 0, "west/x": 1, "eu/y": "garbage", "ap/z": "-1", "sa/w": "7.5"},
    )
    client.hset(
        layout.data_key(rule.name, subject),
        mapping={
            b"h": b"%d" % bucket,
            b"%d" % field_of(0, bucket, ring): 3 * SUBSTEPS,
            b"%d" % field_of(1, bucket - 1, ring): b"%.2e" % (2 * SUBSTEPS),  # float-formatted: 2 units
            b"%d" % field_of(2, bucket, ring): b"4.6116860184273879e+18",  # past 2**53
            b"%d" % field_of(3, bucket, ring): b"garbage",
            b"%d" % (-field_of(1, bucket - 1, ring) - 1): b"nan",
            b"%d" % field_of(4, bucket, ring): b"-640",
            b"not-a-number": b"64",
            b"1.5": b"64",
        },
    )


def test_usage_of_a_key_with_bad_values_answers(redis_url: str, raw: redis.Redis, prefix: str) -> None:
    rule = Rule("api", 100, 10, 1)
    clock = ManualClock(T0 + 0.5)
    subject = b"user:3"
    with Limiter.from_url(redis_url, region="east", rules=[rule], clock=clock, prefix=prefix) as limiter:
        _write_bad_key(raw, limiter.layout, rule, subject, clock.now_us())
        usage = limiter.usage("api", subject)
    assert usage.total == 5
    assert usage.remaining == 95
    assert usage.by_region == {"east": 3, "west": 2}
    assert usage.bad == 6
    assert "bad" not in usage.as_dict()


async def test_async_usage_of_a_key_with_bad_values_answers(redis_url: str, raw: redis.Redis, prefix: str) -> None:
    rule = Rule("api", 100, 10, 1)
    clock = ManualClock(T0 + 0.5)
    subject = b"user:4"
    limiter = AsyncLimiter.from_url(redis_url, region="east", rules=[rule], clock=clock, prefix=prefix)
    try:
        _write_bad_key(raw, limiter.layout, rule, subject, clock.now_us())
        usage = await limiter.usage("api", subject)
    finally:
        await limiter.aclose()
    assert (usage.total, usage.by_region, usage.bad) == (5, {"east": 3, "west": 2}, 6)


@pytest.mark.parametrize("head", [b"garbage", b"4.6116860184273879e+18", b"-3"])
def test_usage_with_an_unreadable_head_answers(redis_url: str, raw: redis.Redis, prefix: str, head: bytes) -> None:
    rule = Rule("api", 100, 10, 1)
    clock = ManualClock(T0)
    subject = b"user:5"
    with Limiter.from_url(redis_url, region="east", rules=[rule], clock=clock, prefix=prefix) as limiter:
        assert limiter.hit("api", subject, 4).allowed
        raw.hset(limiter.layout.data_key("api", subject), "h", head)
        usage = limiter.usage("api", subject)
    assert (usage.total, usage.bad) == (4, 1)

"""A junk low mark that is not a number, or claims less than is true, costs nothing.

Design section 2: a mark 'l' that is not a number is rewritten by the next merge.
Lua's tonumber() reads more than decimal integers (strtod: 'nan', '-inf', '0x10',
'5.5', surrounding spaces), so those are tried too, with marks below the key's
oldest field. A key with an old cell of p1/a and such a mark takes a cell of
p2/b every second for three rings: p1/a's cell must count while in the window and
never after (a field the head's move failed to clear would count as a newer
bucket's), and the mark must end up a true decimal claim.
"""

from __future__ import annotations

import pytest
import redis

from geolimit import AsyncLimiter, ManualClock, Rule
from geolimit.core.cells import bucket_at
from geolimit.replication.redis_io import ReplicationStore, blobs_from_cells

RULE = Rule("api", 10**6, 10, 1)  # N 10, F 2, M 13
M = RULE.ring
CLOCK = ManualClock(1_700_000_000.0)
START = 1_700_000_000.0


@pytest.mark.parametrize("junk", ["abc", "", " ", "nan", "-nan", "-inf", "-5", "0", "1e9", "0x10", "5.5",
                                  " 1700000000 ", "1699999990"])
async def test_a_junk_mark_never_keeps_a_field_a_moving_head_passes(
    redis_url: str, redis_client: redis.Redis, junk: str,
) -> None:
    limiter = AsyncLimiter.from_url(redis_url, region="r", rules=[RULE], clock=CLOCK)
    store = ReplicationStore(limiter.store, limiter.layout, "r", limiter.rules, b"n0", now_us=CLOCK.now_us,
                             peers=["p1", "p2"])
    try:
        CLOCK.set(START)
        c0 = CLOCK.now_us() // RULE.resolution_us
        await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", c0, "p1/a", 64 * 7, 0)]), "p1")
        key = limiter.layout.data_key("api", b"s")
        redis_client.hset(key, "l", junk)
        for i in range(1, 3 * M + 2):
            CLOCK.advance(1)
            now = CLOCK.now_us() // RULE.resolution_us
            await store.merge_blobs(blobs_from_cells(store.layout, [("api", b"s", now, "p2/b", 64, 0)]), "p1")
            usage = await limiter.usage("api", b"s")
            # the window is now - 10 .. now: c0's cell leaves it after 10 moves
            assert usage.by_slot.get("p1/a", 0) == (7 if i <= RULE.buckets else 0), f"move {i}, mark {junk!r}"
            assert usage.by_slot.get("p2/b", 0) == min(i, RULE.buckets + 1)
        fields = redis_client.hgetall(key)
        low, head = int(fields[b"l"]), int(fields[b"h"])
        assert fields[b"l"] == b"%d" % low
        for name in fields:
            if name.lstrip(b"-").isdigit():
                f = int(name)
                assert bucket_at((-f - 1 if f < 0 else f) % M, head, M) >= low
    finally:
        await limiter.aclose()

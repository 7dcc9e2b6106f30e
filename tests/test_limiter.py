"""The sync Limiter against a real Redis and a real 3-master cluster."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis.crc

from geolimit import ConfigError, Limiter, ManualClock, RequestError, Rule, UnknownRuleError

MakeLimiter = Callable[..., Limiter]


def test_fifty_threads_race_for_ten_slots(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 10, 10)])
    barrier = threading.Barrier(50)
    results: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        allowed = limiter.hit("api", "user:42").allowed
        with lock:
            results.append(allowed)

    threads = [threading.Thread(target=worker) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 50
    assert results.count(True) == 10


def test_burst_across_a_window_edge_never_exceeds_the_limit(make_limiter: MakeLimiter) -> None:
    clock = ManualClock(1_700_000_000.0)
    limiter = make_limiter([Rule("api", 10, 10, 1)], clock=clock)
    admitted: list[int] = []
    clock.set(1_700_000_009.95)  # the last moments of one window
    for _ in range(15):
        if limiter.hit("api", "u").allowed:
            admitted.append(clock.now_us())
    clock.set(1_700_000_010.05)  # the first moments of the next
    for _ in range(15):
        if limiter.hit("api", "u").allowed:
            admitted.append(clock.now_us())
    assert len(admitted) == 10
    for t in admitted:
        assert sum(1 for s in admitted if t - 10_000_000 <= s <= t) <= 10
    clock.set(1_700_000_021.0)  # a whole window after the burst: free again
    assert limiter.hit("api", "u").remaining == 9


def test_weighted_cost(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("bytes", 10, 60)])
    assert [limiter.hit("bytes", "k", cost=3).allowed for _ in range(4)] == [True, True, True, False]
    assert limiter.hit("bytes", "k", cost=1).remaining == 0
    assert not limiter.hit("bytes", "k", cost=1).allowed


def test_a_cost_above_the_limit_is_never_allowed(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 5, 10)])
    decision = limiter.hit("api", "k", cost=6)
    assert not decision.allowed
    assert decision.retry_after == float("inf")
    assert decision.as_dict()["retry_after"] is None
    assert limiter.hit("api", "k", cost=5).allowed  # nothing was consumed


def test_a_denying_rule_leaves_the_other_rules_unconsumed(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("burst", 2, 1), Rule("hourly", 100, 3600, 60)])
    assert limiter.hit(["burst", "hourly"], "ip:1.2.3.4").allowed
    assert limiter.hit(["burst", "hourly"], "ip:1.2.3.4").allowed
    denied = limiter.hit(["burst", "hourly"], "ip:1.2.3.4")
    assert not denied.allowed
    assert denied.rule == "burst"
    by_rule = {r.rule: r for r in denied.results}
    assert by_rule["hourly"].allowed
    assert by_rule["hourly"].remaining == 98
    assert limiter.usage("hourly", "ip:1.2.3.4").total == 2


def test_retry_after_is_exact(make_limiter: MakeLimiter) -> None:
    clock = ManualClock(1_700_000_000.25)
    limiter = make_limiter([Rule("api", 3, 2, 0.5)], clock=clock)
    for _ in range(3):
        assert limiter.hit("api", "k").allowed
    clock.advance(0.7)
    denied = limiter.hit("api", "k")
    assert not denied.allowed
    assert denied.retry_after > 0
    wait_us = round(denied.retry_after * 1_000_000)
    clock.advance_us(wait_us - 1)
    assert not limiter.hit("api", "k").allowed, "one microsecond early must still be denied"
    clock.advance_us(1)
    assert limiter.hit("api", "k").allowed, "waiting retry_after must be enough"


def test_peek_consumes_nothing(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 2, 10)])
    assert limiter.peek("api", "k").remaining == 2
    limiter.hit("api", "k")
    peek = limiter.peek("api", "k")
    assert peek.allowed
    assert peek.remaining == 1
    assert not limiter.peek("api", "k", cost=2).allowed
    assert limiter.peek("api", "k").remaining == 1
    assert limiter.hit("api", "k", cost=0).remaining == 1


def test_reset_forgets_and_counting_restarts(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 3, 10), Rule("other", 3, 10)])
    for _ in range(3):
        limiter.hit(["api", "other"], "k")
    assert not limiter.hit("api", "k").allowed
    limiter.reset("api", "k")
    assert limiter.hit("api", "k").remaining == 2
    assert not limiter.hit("other", "k").allowed, "reset of one rule leaves the others"
    limiter.reset(["api", "other"], "never-seen")  # resetting an unknown subject is fine


def test_keys_expire_and_stale_buckets_are_removed(make_limiter: MakeLimiter, raw_client: Any) -> None:
    clock = ManualClock(1_700_000_000.0)
    rule = Rule("api", 100, 10, 1)
    limiter = make_limiter([rule], clock=clock)
    for _ in range(12):
        limiter.hit("api", "k")
        clock.advance(1)
    key = limiter.layout.data_key("api", b"k")
    # The TTL is armed for ttl_ms plus a quarter (re-armed only when it runs low).
    assert rule.ttl_ms < raw_client.pttl(key) <= rule.ttl_ms * 5 // 4 + 1
    fields = raw_client.hgetall(key)
    live = {f for f in fields if f not in (b"h", b"e")}
    assert len(live) <= rule.ring  # positions passed over by the head were cleared
    clock.advance(3600)  # an hour later only the new bucket is left
    limiter.hit("api", "k")
    live = {f for f in raw_client.hgetall(key) if f not in (b"h", b"e")}
    assert live == {b"%d" % ((clock.now_us() // 1_000_000) % rule.ring)}
    assert limiter.usage("api", "k").total == 1


def test_a_ttl_that_runs_low_is_rearmed_by_the_next_write(make_limiter: MakeLimiter, raw_client: Any) -> None:
    clock = ManualClock(1_700_000_000.0)
    rule = Rule("api", 100, 10, 1)
    limiter = make_limiter([rule], clock=clock)
    limiter.hit("api", "k")
    key = limiter.layout.data_key("api", b"k")
    armed = raw_client.pttl(key)
    clock.advance(1)
    limiter.hit("api", "k")  # the head moves, the TTL still lasts: not re-armed
    assert raw_client.pttl(key) <= armed
    # As if ttl_ms had passed on the Redis clock: 500 ms left, and the mark says so.
    mark = int(raw_client.time()[0]) * 1000 + 500
    raw_client.hset(key, b"e", mark)
    raw_client.pexpire(key, 500)
    clock.advance(1)
    limiter.hit("api", "k")
    assert raw_client.pttl(key) > rule.ttl_ms, "the write re-armed the TTL for a full ttl_ms"
    assert limiter.usage("api", "k").total == 3
    clock.advance(1)
    limiter.hit("api", "k")  # and the new mark is trusted again
    assert raw_client.pttl(key) > rule.ttl_ms


@pytest.mark.parametrize(
    "subject",
    ["user:42", "{braces}", "}{", "a:b:c", "with spaces", "ünïcødé ✓", b"\x00\xff\x01{}", "", "x" * 4095],
)
def test_odd_subjects_are_counted_independently(make_limiter: MakeLimiter, subject: str | bytes) -> None:
    limiter = make_limiter([Rule("api", 2, 10), Rule("b", 5, 10)])
    assert limiter.hit(["api", "b"], subject).remaining == 1
    assert limiter.hit("api", subject + (b"!" if isinstance(subject, bytes) else "!")).remaining == 1
    assert limiter.usage("api", subject).total == 1
    layout = limiter.layout
    data = subject.encode() if isinstance(subject, str) else subject
    shard = layout.shard_of(data)
    slots = {redis.crc.key_slot(k) for k in (layout.data_key("api", data), layout.data_key("b", data), *layout.aux_keys(shard))}
    assert len(slots) == 1, "every key of one subject shares one cluster slot"
    assert layout.parse_data_key(layout.data_key("api", data)) == (shard, "api", data)


def test_bad_input_is_rejected_clearly(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 2, 10)])
    with pytest.raises(UnknownRuleError, match="unknown rule 'nope'; known rules: api"):
        limiter.hit("nope", "k")
    for cost in (-1, 1.5, True, "1", 2**60):
        with pytest.raises(RequestError, match="cost"):
            limiter.hit("api", "k", cost=cost)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="subject must be str or bytes"):
        limiter.hit("api", 42)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="4097 bytes"):
        limiter.hit("api", "x" * 4097)
    with pytest.raises(RequestError, match="non-empty"):
        limiter.hit([], "k")
    with pytest.raises(RequestError, match="named twice"):
        limiter.hit(["api", "api"], "k")
    assert limiter.peek("api", "k").remaining == 2, "bad calls consumed nothing"


def test_bad_construction_is_rejected_clearly(backend_url: str) -> None:
    with pytest.raises(ConfigError, match="invalid region name"):
        Limiter.from_url(backend_url, region="us/east", rules=[])
    with pytest.raises(ConfigError, match="on_error"):
        Limiter.from_url(backend_url, region="e", rules=[], on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="duplicate rule name"):
        Limiter.from_url(backend_url, region="e", rules=[Rule("a", 1, 1), Rule("a", 2, 1)])
    with pytest.raises(ConfigError, match="scheme must be"):
        Limiter.from_url("http://127.0.0.1:1/", region="e", rules=[])
    with pytest.raises(ConfigError, match=r"\*\*\*"):
        Limiter.from_url("ftp://user:hunter2@127.0.0.1:1/", region="e", rules=[])


def test_conflicting_rule_structure_is_refused(make_limiter: MakeLimiter) -> None:
    make_limiter([Rule("api", 10, 10, 1)]).hit("api", "k")
    other = make_limiter([Rule("api", 50, 20, 1)])
    with pytest.raises(ConfigError, match="window 20s and resolution 1s here, but window 10s"):
        other.hit("api", "k")
    same_structure = make_limiter([Rule("api", 50, 10, 1)])  # another limit is fine
    assert same_structure.hit("api", "k").remaining == 48


def test_hit_many_decides_each_request(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter([Rule("api", 1, 10)])
    decisions = limiter.hit_many([("api", f"user:{i % 5}", 1) for i in range(10)])
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 5


def test_naming_a_group_of_rates_says_to_pass_its_rules(make_limiter: MakeLimiter) -> None:
    """``Rule.parse_many("api", ...)`` makes ``api.10s`` and ``api.1h``; ``hit("api")`` is
    refused with the list to pass instead (the agent's API and the proxy take the name)."""
    limiter = make_limiter(Rule.parse_many("api", "2/10s;100/hour"))
    with pytest.raises(UnknownRuleError, match=r"\['api.10s', 'api.1h'\] to decide them all-or-nothing"):
        limiter.hit("api", "k")
    assert limiter.hit(["api.10s", "api.1h"], "k").allowed

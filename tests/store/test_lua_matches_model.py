"""The Lua scripts decide exactly like the pure model, on a real Redis."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from geolimit import Limiter, ManualClock, Rule
from geolimit.core.decision import to_rule_decision
from geolimit.core.model import ModelStore

RULES = [
    Rule("fast", 5, 1, 0.1),
    Rule("slow", 12, 10, 1),
    Rule("approx", 8, 4, 1, mode="approximate"),
]

gaps = st.one_of(st.integers(0, 60_000), st.integers(0, 60_000), st.integers(0, 1_200_000), st.integers(0, 2_500_000))
operation = st.one_of(
    st.tuples(
        st.just("hit"),
        gaps,
        st.lists(st.sampled_from(RULES), min_size=1, max_size=3, unique_by=lambda r: r.name),
        st.integers(0, 6),
    ),
    st.tuples(
        st.just("peek"),
        st.integers(0, 400_000),
        st.lists(st.sampled_from(RULES), min_size=1, max_size=2, unique_by=lambda r: r.name),
        st.integers(0, 3),
    ),
    st.tuples(
        st.just("reset"),
        st.integers(0, 400_000),
        st.lists(st.sampled_from(RULES), min_size=1, max_size=3, unique_by=lambda r: r.name),
        st.just(0),
    ),
)


KEEPS_SHARED_REDIS = True  # the module's limiter keeps its state there (tests/conftest.py)


@pytest.fixture(scope="module")
def limiter(redis_url: str) -> Iterator[tuple[Limiter, ManualClock]]:
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()  # another test's region on this shared Redis would be refused
    clock = ManualClock(1_700_000_000.0)
    with Limiter.from_url(redis_url, region="east", rules=RULES, clock=clock) as lim:
        yield lim, clock


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(operation, min_size=1, max_size=40))
def test_hit_peek_and_reset_match_the_model(
    limiter: tuple[Limiter, ManualClock], ops: list[tuple[str, int, list[Rule], int]]
) -> None:
    lim, clock = limiter
    subject = secrets.token_bytes(6) + b"{odd: subject}"
    model = ModelStore("east")
    for kind, gap, rules, cost in ops:
        clock.advance_us(gap)
        names = [r.name for r in rules]
        if kind == "reset":
            lim.reset(names, subject)
            model.reset(rules, subject, clock.now_us())
            continue
        consume = kind == "hit"
        got = lim.hit(names, subject, cost) if consume else lim.peek(names, subject, cost)
        want = [
            to_rule_decision(r, e)
            for r, e in zip(
                rules, model.hit(rules, subject, cost, clock.now_us(), consume), strict=True
            )
        ]
        assert [g.stable_for for g in got.results] == [w.stable_for for w in want], (kind, names, cost)
        assert list(got.results) == want, (kind, names, cost)
        assert got.allowed == all(w.allowed for w in want)
        event(f"{kind} {'allowed' if got.allowed else 'denied'}")
        for r, w in zip(rules, want, strict=True):
            if r.mode == "strict" and w.remaining < w.limit - 1:
                # Several units counted: past the next bucket boundary (the old lower bound) or not.
                boundary = (r.resolution_us - clock.now_us() % r.resolution_us) / 1e6
                event(f"strict, several units: stable_for {'beyond' if w.stable_for > boundary else 'at'} boundary")


spread = st.lists(
    st.tuples(st.sampled_from(["hit", "hit", "peek"]), st.integers(0, 1_500_000), st.sampled_from(RULES[:2]),
              st.integers(0, 3)),
    min_size=3,
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spread)
def test_stable_for_matches_the_model_with_counts_in_several_buckets(
    limiter: tuple[Limiter, ManualClock], ops: list[tuple[str, int, Rule, int]]
) -> None:
    """Strict rules hit across bucket boundaries (no resets): stable_for is when the oldest counted bucket leaves."""
    lim, clock = limiter
    subject = secrets.token_bytes(6)
    model = ModelStore("east")
    for kind, gap, rule, cost in ops:
        clock.advance_us(gap)
        now = clock.now_us()
        sums = model.sums(rule, subject, now)[0]
        consume = kind == "hit"
        got = lim.hit(rule.name, subject, cost) if consume else lim.peek(rule.name, subject, cost)
        (want,) = model.hit([rule], subject, cost, now, consume)
        assert got.results[0] == to_rule_decision(rule, want), (kind, rule.name, cost)
        counted = [d for d, total in enumerate(sums) if total]
        if len(counted) >= 2:
            oldest = now // rule.resolution_us - max(counted)
            assert want.stable_us == (oldest + rule.buckets + 1) * rule.resolution_us - now
            event("counts in several buckets")

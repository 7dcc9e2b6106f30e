"""The Lua scripts decide exactly like the pure model, on a real Redis."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
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

gaps = st.one_of(st.integers(0, 60_000), st.integers(0, 60_000), st.integers(0, 2_500_000))
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


@pytest.fixture(scope="module")
def limiter(redis_url: str) -> Iterator[tuple[Limiter, ManualClock]]:
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
        assert list(got.results) == want, (kind, names, cost)
        assert got.allowed == all(w.allowed for w in want)
        event(f"{kind} {'allowed' if got.allowed else 'denied'}")

"""hit.lua decides escrow rules as geolimit.core.escrow does, on any interleaving of hits,
transfers in and out, peers' adverts and limit changes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geolimit import Limiter, ManualClock, Rule
from geolimit.core.escrow import Advert, EscrowState, Ledger, decide, rights, spare_elsewhere
from geolimit.store.protocol import ESCROW_DENIALS

REGIONS = ("a", "b", "c")
RULE = Rule("esc", 12, 4, 1, escrow=True)  # 4 buckets of 1 s, 4 steps of 250 ms each
LIMITS = (12, 7, 30)
WAIT_US = 300_000

gaps = st.one_of(st.integers(0, 300_000), st.integers(0, 2_000_000))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("hit"), gaps, st.integers(0, 5)),
        st.tuples(st.just("in"), gaps, st.tuples(st.sampled_from(["b", "c"]), st.sampled_from(LIMITS),
                                                  st.integers(1, 6))),
        st.tuples(st.just("out"), gaps, st.tuples(st.sampled_from(["b", "c"]), st.sampled_from(LIMITS),
                                                   st.integers(1, 4))),
        st.tuples(st.just("advert"), gaps, st.tuples(st.sampled_from(["b", "c"]), st.integers(0, 12))),
        st.tuples(st.just("limit"), gaps, st.sampled_from(LIMITS)),
    ),
    min_size=5,
    max_size=40,
)


@pytest.fixture
def setup(redis_url: str, redis_client: redis.Redis) -> Iterator[tuple[Limiter, redis.Redis, ManualClock]]:
    """Region a's limiter on the flushed shared Redis (another test's region there would be refused)."""
    clock = ManualClock(1_700_000_000.0)
    limiter = Limiter.from_url(redis_url, region="a", rules=[RULE], clock=clock)
    client = redis.Redis.from_url(redis_url)
    yield limiter, client, clock
    limiter.close()
    client.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_escrow_decisions_match_the_model(
    setup: tuple[Limiter, redis.Redis, ManualClock], script: list[tuple[str, int, object]]
) -> None:
    limiter, client, clock = setup
    client.hset(limiter.layout.rules_key, "@escrow", f"{','.join(REGIONS)};{WAIT_US}")  # as the agent does
    limiter.set_rules([RULE])
    subject = secrets.token_bytes(8)
    key = limiter.layout.data_key(RULE.name, subject)
    client.hset(limiter.layout.registry_key(limiter.layout.shard_of(subject)), "xo", "1")
    rule = RULE
    state = EscrowState()
    ledger = Ledger(rule.window_us, rule.resolution_us, rule.escrow_steps)
    version = 0
    for kind, gap, arg in script:
        clock.advance_us(gap)
        now = clock.now_us()
        if kind == "hit":
            assert isinstance(arg, int)
            have = rights(state, "a", REGIONS, rule.limit)
            spare = spare_elsewhere(state, "a", rule.limit, have, now // rule.resolution_us, rule.buckets)
            wait = WAIT_US if spare >= arg else None
            model, ledger = decide(ledger, have, now, arg, rule.limit, rights_wait_us=wait)
            got = limiter.hit(rule.name, subject, arg)
            assert got.allowed == model.allowed, (model, got)
            assert got.remaining == max(0, model.rights - model.used), (model, got)
            expected_retry = model.retry_after_us / 1e6 if model.retry_after_us >= 0 else float("inf")
            assert got.retry_after == pytest.approx(expected_retry, abs=1e-6), (model, got)
            assert got.results[0].stable_for == pytest.approx(ledger.stable_us(now) / 1e6, abs=1e-6), (model, got)
        elif kind in ("in", "out"):
            assert isinstance(arg, tuple)
            peer, made_under, amount = arg
            pair = (peer, "a", made_under) if kind == "in" else ("a", peer, made_under)
            total = state.transfers.get(pair, 0) + amount
            state = EscrowState({**state.transfers, pair: total}, state.adverts)
            client.hset(key, f"t:{pair[0]}:{pair[1]}:{pair[2]}", total)
        elif kind == "advert":
            assert isinstance(arg, tuple)
            peer, used = arg
            version += 1
            bucket = now // rule.resolution_us
            state = EscrowState(state.transfers, {**state.adverts, peer: Advert(version, used, 0, bucket)})
            client.hset(key, f"a:{peer}", f"{version}:{used}:0:{bucket}")
        else:
            assert isinstance(arg, int)
            rule = RULE.with_limit(arg)
            limiter.set_rules([rule])


def test_escrow_rules_are_denied_with_a_reason_until_the_regions_are_known(
    setup: tuple[Limiter, redis.Redis, ManualClock],
) -> None:
    limiter, client, _ = setup
    client.flushdb()
    denied = limiter.hit(RULE.name, "user")
    assert not denied.allowed
    assert denied.error == ESCROW_DENIALS[-1]
    client.hset(limiter.layout.rules_key, "@escrow", "a,b,c;300000")
    limiter._check_due = 0.0  # the next decision looks again (a limiter does every second meanwhile)
    held = limiter.hit(RULE.name, "user")
    assert not held.allowed
    assert held.error == ESCROW_DENIALS[-2]  # a fresh Redis: held until the agent restores

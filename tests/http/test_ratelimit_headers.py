"""The IETF RateLimit fields to the letter (draft-ietf-httpapi-ratelimit-headers-11), parsed with http_sfv.

The property tests drive a real Redis with a manual clock: after every decision
they spend, within the advertised effective window ``t``, as much as the server
admits, and check it is never more than the advertised ``r``.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Iterator
from typing import Any

import http_sfv
import pytest

from geolimit import Limiter, ManualClock, Rule
from geolimit.core.decision import Decision, RuleDecision, combine
from geolimit.http.headers import (
    QUOTA_EXCEEDED,
    QuotaUnit,
    problem_body,
    problem_document,
    problem_instance,
    rate_limit_headers,
)


def sf_list(value: str) -> list[tuple[Any, dict[str, Any]]]:
    parsed = http_sfv.List()
    parsed.parse(value.encode("ascii"))
    return [(item.value, dict(item.params)) for item in parsed]


def result(rule: str, allowed: bool, remaining: int, retry: float = 0.0, reset: float = 5.0,
           window: float = 60.0, stable: float = 2.5, limit: int = 10) -> RuleDecision:
    return RuleDecision(rule, allowed, limit, remaining, retry, reset, window, stable)


def fields(decision: Decision, units: list[QuotaUnit] | None = None, legacy: bool = False) -> dict[str, str]:
    return dict(rate_limit_headers(decision, legacy=legacy, units=units))


def test_fields_are_structured_field_lists() -> None:
    headers = fields(combine([result("api", True, 7, stable=12.9), result('we"ird', True, 3, stable=0.4)]))
    assert sf_list(headers["RateLimit-Policy"]) == [("api", {"q": 10, "w": 60}), ('we"ird', {"q": 10, "w": 60})]
    assert sf_list(headers["RateLimit"]) == [("api", {"r": 7, "t": 12}), ('we"ird', {"r": 3, "t": 0})]
    assert "Retry-After" not in headers


def test_t_is_the_time_the_available_quota_cannot_grow_not_the_time_until_empty() -> None:
    # Allowed: t comes from stable_for (rounded down), never from reset_after (the window emptying).
    headers = fields(combine([result("api", True, 0, reset=10.0, stable=3.7)]))
    assert sf_list(headers["RateLimit"]) == [("api", {"r": 0, "t": 3})]
    # Denied at cost 1: no further request fits until retry_after, which is exact.
    headers = fields(combine([result("api", False, 0, retry=6.2, reset=10.0, stable=0.5)]))
    assert sf_list(headers["RateLimit"]) == [("api", {"r": 0, "t": 6})]
    assert headers["Retry-After"] == "7"


def test_retry_after_is_never_earlier_than_any_effective_window() -> None:
    # "burst" denies for 2.5 s; "api" allows with a long stable time: its t is cut to Retry-After.
    decision = combine([result("api", True, 4, stable=50.0, window=3600), result("burst", False, 0, retry=2.5)])
    headers = fields(decision)
    retry_after = int(headers["Retry-After"])
    assert retry_after == 3
    assert all(params["t"] <= retry_after for _, params in sf_list(headers["RateLimit"]))
    never = fields(combine([result("api", False, 0, retry=float("inf"), window=60.0, stable=7.5)]))
    assert "Retry-After" not in never, "a cost above the limit never fits: no wait would help"
    assert sf_list(never["RateLimit"]) == [("api", {"r": 0, "t": 7})]
    # With a rule that a wait would satisfy, the request still can never pass: no Retry-After either.
    both = fields(combine([result("burst", False, 0, retry=3.0), result("api", False, 0, retry=float("inf"))]))
    assert "Retry-After" not in both


def test_byte_quotas_send_content_bytes_and_fixed_costs_count_requests() -> None:
    upload = result("upload", True, 700, limit=1000)
    api = result("api", True, 8, limit=10)
    headers = fields(combine([upload, api]), [QuotaUnit.of(300, fixed=False, content_bytes=True),
                                               QuotaUnit.of(3, fixed=True)])
    assert sf_list(headers["RateLimit-Policy"]) == [
        ("upload", {"q": 1000, "qu": "content-bytes", "w": 60}), ("api", {"q": 3, "w": 60})]
    assert sf_list(headers["RateLimit"])[1] == ("api", {"r": 2, "t": 2}), "8 units left: two requests of 3"
    # A request costing 3 with 2 units left is denied: r is 0 requests, t is the exact wait.
    denied = combine([result("api", False, 2, retry=4.0, limit=10)])
    headers = fields(denied, [QuotaUnit.of(3, fixed=True)])
    assert sf_list(headers["RateLimit"]) == [("api", {"r": 0, "t": 4})]


def test_sub_second_windows_leave_out_w() -> None:
    headers = fields(combine([result("tiny", True, 3, window=0.25, stable=0.1), result("odd", True, 3, window=1.5)]))
    assert sf_list(headers["RateLimit-Policy"]) == [("tiny", {"q": 10}), ("odd", {"q": 10})]


def test_legacy_fields_follow_the_binding_rule_in_the_same_units() -> None:
    decision = combine([result("api", True, 9, reset=30.0), result("burst", True, 1, reset=1.2)])
    headers = fields(decision, legacy=True)
    assert (headers["X-RateLimit-Limit"], headers["X-RateLimit-Remaining"], headers["X-RateLimit-Reset"]) == (
        "10", "1", "2")
    denied = combine([result("api", False, 1, retry=9.0, reset=30.0, limit=10)])
    headers = fields(denied, [QuotaUnit.of(2, fixed=True)], legacy=True)
    assert (headers["X-RateLimit-Limit"], headers["X-RateLimit-Remaining"]) == ("5", "0")


def test_the_denial_is_a_quota_exceeded_problem_with_violated_policies() -> None:
    decision = combine([result("api", True, 4), result("burst", False, 0, retry=4.2), result("daily", False, 0,
                                                                                              retry=300.0)])
    doc = json.loads(problem_body(decision, "/search"))
    assert doc["type"] == QUOTA_EXCEEDED == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert doc["status"] == 429
    assert doc["violated-policies"] == ["burst", "daily"]
    assert doc["rule"] == "daily"
    assert doc["retry_after"] == 300.0
    assert doc["instance"] == "/search"
    never = combine([result("api", False, 0, retry=float("inf"))])
    assert json.loads(problem_body(never))["retry_after"] is None


def test_the_denial_names_the_window_of_the_rule_that_denied() -> None:
    """A multi-rate route ("10/hour;5/minute") denied by its minute rule said "5 per 3600 s"."""
    minute = result("multi.1m", False, 0, retry=20.0, limit=5, window=60.0)
    decision = combine([result("multi.1h", True, 6, limit=10, window=3600.0), minute])
    assert json.loads(problem_body(decision))["detail"] == "rate limit 'multi.1m' exceeded: 5 per 60 s"


@pytest.mark.parametrize(
    ("path", "instance"),
    [
        ("/search", "/search"),
        ("/a b/ü", "/a%20b/%C3%BC"),
        ("/100%/x", "/100%25/x"),
        ("//evil.example/x", "/%2Fevil.example/x"),
        ('/q"<>{}|\\^`#?', "/q%22%3C%3E%7B%7D%7C%5C%5E%60%23%3F"),
        ("/users/@me:1;v=2", "/users/@me:1;v=2"),
        ("", "/"),
    ],
)
def test_instance_is_a_percent_encoded_uri_reference(path: str, instance: str) -> None:
    assert problem_instance(path) == instance
    assert json.loads(problem_document(502, "Bad Gateway", "x", path))["instance"] == instance
    assert instance.isascii()
    assert " " not in instance
    assert not instance.startswith("//")


# --- the effective window against a real Redis ----------------------------------------------------------


@pytest.fixture
def limiter_for(redis_url: str) -> Iterator[Any]:
    made: list[Limiter] = []

    def make(rule: Rule, clock: ManualClock) -> Limiter:
        limiter = Limiter.from_url(redis_url, region="east", rules=[rule], clock=clock,
                                   prefix="h" + secrets.token_hex(4))
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        limiter.close()


def advertised(decision: Decision, cost: int) -> tuple[int, int, int | None]:
    """``(r, t, Retry-After)`` of a one-rule decision whose requests cost ``cost``."""
    headers = fields(decision, [QuotaUnit.of(cost, fixed=True)])
    [(_, params)] = sf_list(headers["RateLimit"])
    retry = headers.get("Retry-After")
    return params["r"], params["t"], None if retry is None else int(retry)


@pytest.mark.parametrize(
    ("rule", "cost"),
    [
        (Rule("strict", 10, 10, 1), 1),
        (Rule("strict3", 10, 10, 1), 3),
        (Rule("coarse", 20, 60, 6), 1),
        (Rule("approx", 10, 10, 1, mode="approximate"), 1),
        (Rule("approx2", 12, 10, 2, mode="approximate"), 2),
    ],
    ids=lambda v: v.name if isinstance(v, Rule) else str(v),
)
def test_no_more_than_r_is_admitted_within_t(limiter_for: Any, rule: Rule, cost: int) -> None:
    rng = random.Random(f"{rule.name}/{cost}")
    clock = ManualClock(1_700_000_000.123456)
    limiter = limiter_for(rule, clock)
    checked = 0
    for _ in range(120):
        clock.advance_us(rng.randrange(0, 2_500_000))
        for _ in range(rng.randrange(0, 4)):
            limiter.hit(rule.name, "client", cost)
        decision = limiter.hit(rule.name, "client", cost)
        r, t, retry_after = advertised(decision, cost)
        if retry_after is not None:
            assert t <= retry_after, "Retry-After must not end before the effective window"
        start = clock.now_us()
        admitted = 0
        while admitted <= r and limiter.hit(rule.name, "client", cost).allowed:
            admitted += 1
        assert admitted == r, f"r={r} requests of cost {cost} are available now, {admitted} were admitted"
        if t > 0:
            clock.set_us(start + t * 1_000_000 - 1)
            while admitted <= r and limiter.hit(rule.name, "client", cost).allowed:
                admitted += 1
        assert admitted <= r, f"r={r};t={t} but {admitted} requests were admitted within {t} s"
        checked += t > 0
    assert checked > 10, "the scenario must exercise non-zero effective windows"


def test_a_request_before_t_after_r0_is_denied(limiter_for: Any) -> None:
    """After ``r=0;t=T`` a request just before T s is denied and one at T s is admitted (T < reset_after)."""
    clock = ManualClock(1_700_000_000.0)
    limiter = limiter_for(Rule("api", 5, 10, 1), clock)
    for _ in range(4):
        limiter.hit("api", "client")
    clock.advance(4.0)
    last = limiter.hit("api", "client")
    assert last.allowed
    assert last.remaining == 0
    denied = limiter.hit("api", "client")
    r, t, retry_after = advertised(denied, 1)
    # Strict windows count 11 one-second buckets: the first four leave 11 - 4 = 7 s from now.
    assert (r, t, retry_after) == (0, 7, 7)
    assert denied.reset_after == 11.0, "the window is empty only 11 s from now: reset_after, longer than t"
    clock.advance(t - 0.001)
    assert not limiter.hit("api", "client").allowed
    clock.advance(0.001)
    assert limiter.hit("api", "client").allowed


def test_a_lone_request_advertises_its_whole_window(limiter_for: Any) -> None:
    clock = ManualClock(1_700_000_000.5)
    limiter = limiter_for(Rule("api", 5, 10, 1), clock)
    r, t, _ = advertised(limiter.hit("api", "client"), 1)
    assert (r, t) == (4, 10), "its bucket is the only one counted: nothing frees up before it leaves (10.5 s)"

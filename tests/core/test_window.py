"""Window maths and the decision rule, against an exact sliding-log oracle."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from geolimit.core.decision import to_rule_decision
from geolimit.core.model import ModelStore
from geolimit.core.rule import Rule
from geolimit.core.usage import slot_names
from geolimit.core.window import (
    MARGIN,
    MAX_CELL_VALUE,
    SUBSTEPS,
    bucket_at,
    evaluate,
    field_of,
    floor_field_of,
    parse_stored_int,
    read_key,
    split_field,
    window_sums,
)

SUBJECT = b"user:42"
T0 = 1_700_000_000_000_000

events = st.lists(
    st.tuples(st.integers(0, 1_500_000), st.integers(0, 4)),  # (gap in us, cost)
    min_size=1,
    max_size=120,
)

def _rules(modes: list[str]) -> st.SearchStrategy[Rule]:
    return st.builds(
        lambda limit, buckets, res_ms, mode: Rule("r", limit, buckets * res_ms / 1000, res_ms / 1000, mode=mode),
        st.integers(0, 12),
        st.integers(1, 8),
        st.sampled_from([1, 7, 100, 250, 1000]),
        st.sampled_from(modes),
    )


rules = _rules(["strict", "approximate"])
strict_rules = _rules(["strict"])  # approximate mode may admit more than the limit in some windows


def oracle_max_in_any_window(admitted: list[tuple[int, int]], window_us: int) -> int:
    """Exact: the most cost admitted in any closed window [t - W, t]."""
    worst = 0
    for t, _ in admitted:
        worst = max(worst, sum(c for s, c in admitted if t - window_us <= s <= t))
    return worst


@settings(max_examples=300, deadline=None)
@given(strict_rules, events)
def test_strict_mode_never_admits_more_than_the_limit_in_any_window(rule: Rule, trace: list[tuple[int, int]]) -> None:
    store = ModelStore("a")
    now = T0
    admitted: list[tuple[int, int]] = []
    for gap, cost in trace:
        now += gap
        (result,) = store.hit([rule], SUBJECT, cost, now)
        if result.allowed and cost:
            admitted.append((now, cost))
    assert oracle_max_in_any_window(admitted, rule.window_us) <= rule.limit


@settings(max_examples=300, deadline=None)
@given(rules, events)
def test_retry_after_is_exact(rule: Rule, trace: list[tuple[int, int]]) -> None:
    store = ModelStore("a")
    now = T0
    for gap, cost in trace:
        now += gap
        (result,) = store.hit([rule], SUBJECT, cost, now)
        if result.allowed or result.retry_after_us < 0:
            continue
        wait = result.retry_after_us
        assert wait > 0
        (later,) = store.hit([rule], SUBJECT, cost, now + wait, consume=False)
        assert later.allowed, "waiting retry_after must be enough"
        (earlier,) = store.hit([rule], SUBJECT, cost, now + wait - 1, consume=False)
        assert not earlier.allowed, "retry_after must not be longer than needed"


@settings(max_examples=200, deadline=None)
@given(rules, events)
def test_reset_after_is_when_the_window_empties(rule: Rule, trace: list[tuple[int, int]]) -> None:
    store = ModelStore("a")
    now = T0
    for gap, cost in trace:
        now += gap
        store.hit([rule], SUBJECT, cost, now)
    (peek,) = store.hit([rule], SUBJECT, 0, now, consume=False)
    sums, _ = store.sums(rule, SUBJECT, now + peek.reset_after_us)
    assert sum(sums) == 0
    if peek.reset_after_us:
        sums, _ = store.sums(rule, SUBJECT, now + peek.reset_after_us - 1)
        assert sum(sums) > 0


def test_a_cost_larger_than_the_limit_can_never_pass() -> None:
    rule = Rule("r", 3, 10)
    (result,) = ModelStore("a").hit([rule], SUBJECT, 4, T0)
    assert not result.allowed
    assert result.retry_after_us == -1


def test_window_edge_burst_is_refused() -> None:
    """limit at the end of one window plus limit at the start of the next is refused."""
    rule = Rule("r", 10, 10, 1)
    store = ModelStore("a")
    end_of_window = T0 + 9_999_000
    assert all(r.allowed for _ in range(10) for r in store.hit([rule], SUBJECT, 1, end_of_window))
    start_of_next = T0 + 10_001_000
    (result,) = store.hit([rule], SUBJECT, 1, start_of_next)
    assert not result.allowed


def test_approximate_mode_weights_the_oldest_bucket() -> None:
    """Half of the oldest bucket is gone: approximate mode counts a bit more than half of
    its 100 (a margin of MARGIN * sqrt(100) for lumpy traffic, scaled by the weight), strict all of it."""
    rule = Rule("r", 100, 10, 1, mode="approximate")
    strict = Rule("r", 100, 10, 1)
    now = 1_700_000_000_000_000  # on a bucket boundary
    sums = [0] * 10 + [100]  # the oldest bucket holds 100
    half_gone = now + 500_000
    assert not evaluate(sums, {}, half_gone, 1, strict.limit, strict.resolution_us).allowed
    approx = evaluate(sums, {}, half_gone, 1, rule.limit, rule.resolution_us, approximate=True)
    assert approx.allowed
    assert approx.used == 1 + math.ceil(0.5 * (100 + MARGIN * 10))
    assert 51 < approx.used < 100


def test_multi_rule_denial_consumes_nothing_in_the_model() -> None:
    wide, narrow = Rule("wide", 10, 10), Rule("narrow", 1, 10)
    store = ModelStore("a")
    assert all(r.allowed for r in store.hit([wide, narrow], SUBJECT, 1, T0))
    second = store.hit([wide, narrow], SUBJECT, 1, T0)
    assert [r.allowed for r in second] == [True, False]
    assert second[0].used == 1  # wide was not charged for the refused request


def test_ring_positions_round_trip() -> None:
    ring, head = 13, 1029
    recent = range(head - ring + 1, head + 1)  # the buckets a ring holds below its head
    for slot in range(4):
        for bucket in range(1000, 1030):
            f = field_of(slot, bucket, ring)
            assert split_field(f, ring)[:2] == (False, slot)
            assert split_field(floor_field_of(f), ring) == (True, slot, split_field(f, ring)[2])
            held = bucket_at(split_field(f, ring)[2], head, ring)
            if bucket in recent:
                assert held == bucket
            else:  # an older bucket's position now holds the recent bucket that reused it
                assert held in recent
                assert (held - bucket) % ring == 0


def test_read_key_classifies_live_future_and_stale_fields() -> None:
    ring, n = 13, 10
    head = 1000
    fields = {b"h": b"%d" % head}
    for bucket, count in ((1000, 5), (995, 3), (990, 2), (989, 9)):  # stored as count * SUBSTEPS + first offset
        fields[b"%d" % field_of(0, bucket, ring)] = b"%d" % (count * SUBSTEPS + 7)
    fields[b"%d" % field_of(1, 1000, ring)] = b"%d" % (4 * SUBSTEPS + 2)
    fields[b"%d" % -(field_of(1, 1000, ring) + 1)] = b"%d" % (1 * SUBSTEPS + 2)  # floor of slot 1 at bucket 1000
    view = read_key(fields, 1000, n, ring)
    assert view.sums[0] == 5 + 3  # own 5 + (4 - floor 1)
    assert view.sums[5] == 3
    assert view.sums[10] == 2
    assert view.own == 5 * SUBSTEPS + 7
    assert view.firsts[0] == 2
    assert sum(view.sums) == 13  # 989 is outside the window
    later = read_key(fields, 1003, n, ring)  # positions of 1001..1003 are reused: 988..990 stale
    assert b"%d" % field_of(0, 990, ring) in later.stale
    assert b"%d" % field_of(0, 989, ring) in later.stale
    early = read_key(fields, 999, n, ring)  # the head is one bucket in the future
    assert early.future == {1000: 8}


def test_window_sums_split() -> None:
    sums, future = window_sums({100: 1, 95: 2, 90: 3, 89: 4, 101: 5}, 100, 10)
    assert sums[0] == 1
    assert sums[5] == 2
    assert sums[10] == 3
    assert future == {101: 5}


@pytest.mark.parametrize(
    ("raw", "signed", "want"),
    [
        (b"0", False, 0),
        (b"6400000000", False, 6_400_000_000),
        (b"6.4e+09", False, 6_400_000_000),  # Redis 7.2.0-7.2.4 wrote round Lua numbers like this
        (b"6.4E9", False, 6_400_000_000),
        (b"1.0", False, 1),
        (b"-0", False, 0),
        (b"007", False, 7),
        (b"%d" % MAX_CELL_VALUE, False, MAX_CELL_VALUE),
        (b"%d" % (MAX_CELL_VALUE + 1), False, None),
        (b"4.6116860184273879e+18", False, None),  # past 2**53: no longer exact
        (b"9007199254740992.0", False, None),
        (b"1.5", False, None),
        (b"-64", False, None),
        (b"-64", True, -64),
        (b"-6.4e+01", True, -64),
        (b"garbage", False, None),
        (b"", False, None),
        (b" 5", False, None),
        (b"5 ", False, None),
        (b"+5", False, None),
        (b"1_000", False, None),
        (b"0x10", False, None),
        (b"nan", False, None),
        (b"NaN", True, None),
        (b"inf", False, None),
        (b"-inf", True, None),
        (b"1e400", False, None),
        (b"1" * 5000, False, None),  # int() would raise for so many digits
        (b"\xff\xfe", False, None),
        ("12", False, 12),
        ("\u0661\u0662", False, None),  # int() accepts Arabic-Indic digits; Lua does not
    ],
)
def test_parse_stored_int(raw: bytes | str, signed: bool, want: int | None) -> None:
    assert parse_stored_int(raw, signed=signed) == want


def _good_key(ring: int) -> dict[bytes, bytes]:
    fields = {b"h": b"1000"}
    fields[b"%d" % field_of(0, 1000, ring)] = b"%d" % (5 * SUBSTEPS + 7)
    fields[b"%d" % field_of(1, 999, ring)] = b"%d" % (3 * SUBSTEPS)
    return fields


def test_read_key_ignores_and_counts_bad_fields() -> None:
    ring, n = 13, 10
    good = read_key(_good_key(ring), 1000, n, ring)
    assert (good.sums[0], good.sums[1], good.bad) == (5, 3, 0)
    fields = _good_key(ring)
    fields[b"%d" % field_of(2, 1000, ring)] = b"4.6116860184273879e+18"  # above 2**53: ignored
    fields[b"%d" % field_of(3, 1000, ring)] = b"garbage"
    fields[b"%d" % -(field_of(0, 1000, ring) + 1)] = b"nan"  # a floor that is not a number
    fields[b"%d" % field_of(4, 1000, ring)] = b"-640"  # values are never negative
    fields[b"not-a-field"] = b"64"
    fields[b"1.5"] = b"64"
    fields[b"1" * 5000] = b"64"
    view = read_key(fields, 1000, n, ring)
    assert (view.sums, view.future, view.head, view.own, view.firsts) == (
        good.sums, good.future, good.head, good.own, good.firsts
    )
    assert view.cells == good.cells
    assert view.bad == 7


def test_read_key_accepts_float_formatted_integers() -> None:
    ring, n = 13, 10
    fields = {b"h": b"1e+03"}
    fields[b"%d" % field_of(0, 1000, ring)] = b"6.4e+09"  # 100_000_000 units, first offset 0
    fields[b"%d" % -(field_of(0, 1000, ring) + 1)] = b"3.2e+09"  # floor: 50_000_000 units
    view = read_key(fields, 1000, n, ring)
    assert view.head == 1000
    assert view.sums[0] == 50_000_000
    assert view.own == 6_400_000_000
    assert view.cells == {(0, 1000): (6_400_000_000, 3_200_000_000)}
    assert view.bad == 0


@pytest.mark.parametrize("head", [b"garbage", b"-5", b"1.5", b"4.6116860184273879e+18"])
def test_read_key_with_an_unreadable_head_reads_as_headless(head: bytes) -> None:
    ring, n = 13, 10
    fields = _good_key(ring) | {b"h": head}
    view = read_key(fields, 1000, n, ring)
    assert view.head is None
    assert (view.sums[0], view.sums[1]) == (5, 3)  # positions read relative to the current bucket
    assert view.bad == 1


def test_slot_names_skip_unreadable_indexes() -> None:
    registry = {
        b"@": b"abc", b"#": b"4", b"a": b"garbage",
        b"east/abc": b"0", b"west/x": b"1", b"eu/y": b"2.0", b"ap/z": b"bad", b"sa/w": b"-1", b"us/v": b"1.5",
    }
    assert slot_names(registry) == {0: "east/abc", 1: "west/x", 2: "eu/y"}


def test_stable_for_is_until_the_oldest_counted_bucket_leaves() -> None:
    """Issue 11 §2: units in several buckets; t is exact, not the next bucket boundary."""
    rule = Rule("api", 3, 10, 1)  # 3 per 10 s, 1 s buckets: N + 1 = 11 buckets counted
    store = ModelStore("a")
    second = 1_000_000
    for at in (200_000, 3 * second + 500_000):
        (allowed,) = store.hit([rule], SUBJECT, 1, T0 + at)
        assert allowed.allowed
    now = T0 + 7 * second + 900_000
    (last,) = store.hit([rule], SUBJECT, 1, now)
    assert (last.allowed, rule.limit - last.used) == (True, 0)
    # Bucket 0 (the 0.2 s unit) leaves the counted window at 11 s: 3.1 s from now.
    assert last.stable_us == 11 * second - 7 * second - 900_000
    assert to_rule_decision(rule, last).stable_for == pytest.approx(3.1)
    (before,) = store.hit([rule], SUBJECT, 1, now + last.stable_us - 1, consume=False)
    assert not before.allowed, "1 us before: the oldest unit still counts"
    (at_t,) = store.hit([rule], SUBJECT, 1, now + last.stable_us, consume=False)
    assert at_t.allowed, "at stable_for: admitted"
    # A peek at that time: nothing counted before the 3.5 s unit, which leaves at 14 s.
    assert at_t.stable_us == 3 * second


@settings(max_examples=300, deadline=None)
@given(rules, events, st.integers(0, 4))
def test_remaining_cannot_grow_within_stable_for_and_strict_grows_right_after(
    rule: Rule, trace: list[tuple[int, int]], cost: int
) -> None:
    store = ModelStore("a")
    now = T0
    for gap, c in trace:
        now += gap
        store.hit([rule], SUBJECT, c, now)
    (result,) = store.hit([rule], SUBJECT, cost, now)
    remaining = max(0, rule.limit - result.used)
    stable = result.stable_us
    for at in {now, now + stable // 2, now + stable - 1}:
        if at >= now:
            (later,) = store.hit([rule], SUBJECT, 0, at, consume=False)
            assert max(0, rule.limit - later.used) <= remaining, at - now
    if rule.mode == "strict" and result.reset_after_us > 0 and rule.limit > 0:
        (after,) = store.hit([rule], SUBJECT, 0, now + stable, consume=False)
        assert after.used < result.used, "strict: exact, the oldest counted bucket has left"


@settings(max_examples=300, deadline=None)
@example(sums=[0, 0, 4], reserve=0.5, cost=1, limit=5, approximate=False, offset=0)  # the r=1 denial
@example(sums=[0, 0, 0], reserve=2.220446049250313e-16, cost=2, limit=2, approximate=False, offset=0)  # rounding
@given(sums=st.lists(st.integers(0, 8), min_size=3, max_size=3), reserve=st.floats(0, 6),
       cost=st.integers(1, 6), limit=st.integers(1, 20), approximate=st.booleans(), offset=st.integers(0, 999_999))
def test_a_request_costing_at_most_what_remains_is_admitted(
    sums: list[int], reserve: float, cost: int, limit: int, approximate: bool, offset: int,
) -> None:
    """``limit - used`` (the headers' ``r``) is what a request may still cost, in both modes. In strict
    mode a fractional reservation for peers was truncated: 4.5 counted showed 1 left, then denied 1.

    The other way round holds up to float rounding: a count whose fraction is below the
    resolution of ``count + cost`` (a reserve of 2.2e-16, cost 2 of 2) is admitted while ``r``
    says 1, one unit on the safe side, never more."""
    now = 100 * 1_000_000 + offset
    peek = evaluate(sums, {}, now, cost, limit, 1_000_000, approximate, consume=False, reserve=reserve)
    hit = evaluate(sums, {}, now, cost, limit, 1_000_000, approximate, consume=True, reserve=reserve)
    if cost <= limit - peek.used:
        assert hit.allowed
    if hit.allowed:
        assert cost <= limit - peek.used + 1

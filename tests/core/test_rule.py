"""Rules and rate strings."""

from __future__ import annotations

import pytest

from geolimit import ConfigError, Rule, parse_rate
from geolimit.core.rule import MAX_CLOCK_SKEW, parse_duration
from geolimit.core.window import MAX_CELL_VALUE, MAX_COUNT, SUBSTEPS, bucket_of, field_of, read_key


def test_default_resolution_is_a_tenth_of_the_window() -> None:
    rule = Rule("api", limit=5, window=10)
    assert rule.resolution == 1.0
    assert rule.buckets == 10
    assert rule.window_us == 10_000_000


@pytest.mark.parametrize(
    ("text", "limit", "window"),
    [
        ("100/minute", 100, 60.0),
        ("1000/10s", 1000, 10.0),
        ("5 per hour", 5, 3600.0),
        ("10/2m", 10, 120.0),
        ("10 / 2 minutes", 10, 120.0),
        ("7/250ms", 7, 0.25),
        ("3 PER Day", 3, 86400.0),
        ("1/1.5s", 1, 1.5),
    ],
)
def test_rate_strings(text: str, limit: int, window: float) -> None:
    assert parse_rate(text) == (limit, window)
    rule = Rule.from_string("r", text)
    assert (rule.limit, rule.window) == (limit, window)


@pytest.mark.parametrize("text", ["", "100", "abc/minute", "10/fortnight", "-1/s", "10//s", "10/0s", "1e3/s"])
def test_bad_rate_strings_quote_the_text(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        Rule.from_string("r", text)
    assert repr(text) in str(info.value)


def test_resolution_may_be_a_duration_string() -> None:
    rule = Rule.from_string("api", "1000/10s", resolution="500ms")
    assert rule.buckets == 20


def test_window_must_be_a_multiple_of_the_resolution() -> None:
    with pytest.raises(ConfigError, match="whole multiple of resolution"):
        Rule("api", 10, window=10, resolution=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "has space", "limit": 1, "window": 1}, "invalid rule name"),
        ({"name": "a:b", "limit": 1, "window": 1}, "invalid rule name"),
        ({"name": "", "limit": 1, "window": 1}, "invalid rule name"),
        ({"name": "r", "limit": -1, "window": 1}, r"limit must be an integer from 0 to 2\*\*46 \(70368744177664\)"),
        ({"name": "r", "limit": 2**46 + 1, "window": 1}, r"limit must be an integer from 0 to 2\*\*46"),
        ({"name": "r", "limit": 2**50, "window": 1}, r"limit must be an integer from 0 to 2\*\*46"),
        ({"name": "r", "limit": 1.5, "window": 1}, "limit must be an integer"),
        ({"name": "r", "limit": True, "window": 1}, "limit must be an integer"),
        ({"name": "r", "limit": 1, "window": 0}, "positive number of seconds"),
        ({"name": "r", "limit": 1, "window": float("nan")}, "positive number of seconds"),
        ({"name": "r", "limit": 1, "window": "10"}, "must be a number of seconds"),
        ({"name": "r", "limit": 1, "window": "10s"}, r"got '10s' \(write 10, or use Rule.from_string for rate"),
        ({"name": "r", "limit": 1, "window": 60, "resolution": "1m"}, r"resolution .* \(write 60, "),
        ({"name": "r", "limit": 1, "window": 1, "resolution": 0.0001}, "below the minimum of 1 ms"),
        ({"name": "r", "limit": 1, "window": 86400, "resolution": 1}, "buckets per window"),
        ({"name": "r", "limit": 1, "window": 1, "mode": "fuzzy"}, "mode must be"),
    ],
)
def test_invalid_rules_have_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Rule(**kwargs)  # type: ignore[arg-type]


def test_the_largest_limit_is_max_count() -> None:
    assert MAX_COUNT == 2**46
    assert Rule("r", MAX_COUNT, 1).limit == MAX_COUNT
    assert Rule("r", 0, 1).limit == 0
    # The largest cell value a rule can produce stays exact in a Lua double.
    assert MAX_COUNT * SUBSTEPS + SUBSTEPS - 1 <= MAX_CELL_VALUE == 2**53 - 1


def test_durations() -> None:
    assert parse_duration("minute") == 60
    assert parse_duration("2h") == 7200
    with pytest.raises(ConfigError, match="'5 parsecs'"):
        parse_duration("5 parsecs")


@pytest.mark.parametrize(("window", "resolution"), [(10, 1), (0.001, 0.001), (60, 0.25), (3600, 60), (3, 3), (7, 0.7)])
def test_a_key_holds_the_window_and_cells_from_clocks_up_to_the_skew_ahead(window: float, resolution: float) -> None:
    rule = Rule("api", 1000, window, resolution)
    skew_us = round(MAX_CLOCK_SKEW * 1_000_000)
    for now_us in (1_700_000_000_000_000, 1_700_000_000_000_000 + rule.resolution_us - 1):
        current = bucket_of(now_us, rule.resolution_us)
        ahead = bucket_of(now_us + skew_us, rule.resolution_us)  # written by a region whose clock runs ahead
        # One unit in every bucket from the oldest counted one to the one furthest ahead.
        live = range(current - rule.buckets, ahead + 1)
        fields = {b"h": b"%d" % ahead} | {b"%d" % field_of(0, b, rule.ring): b"%d" % SUBSTEPS for b in live}
        assert len(fields) == len(live) + 1, "two live buckets share a ring position"
        view = read_key(fields, current, rule.buckets, rule.ring)
        assert view.stale == []
        assert view.sums == [1] * (rule.buckets + 1)
        assert view.future == dict.fromkeys(range(current + 1, ahead + 1), 1)
        # The key outlives its newest cell's time in the window: written now, the cell
        # furthest ahead is counted until its bucket leaves the window.
        leaves_us = (ahead + rule.buckets + 1) * rule.resolution_us
        assert now_us + rule.ttl_ms * 1000 >= leaves_us


def test_limit_changes_keep_the_structure() -> None:
    rule = Rule("api", 10, 60)
    bigger = rule.with_limit(20)
    assert bigger.structure == rule.structure
    assert bigger.limit == 20
    assert rule.describe() == "10/60s (6s buckets, strict)"


@pytest.mark.parametrize(("rates", "window"), [("10/ms", "0.001"), ("10/1ms", "0.001"), ("10/5ms", "0.005")])
def test_a_window_too_short_for_the_default_buckets_says_so(rates: str, window: str) -> None:
    """Once: "resolution 0.0001s is below the minimum of 1 ms", for a resolution nobody set."""
    with pytest.raises(ConfigError) as caught:
        Rule.parse_many("api", rates)
    message = str(caught.value)
    assert message.startswith(f"rule 'api': window {window}s is too short for the default 10 buckets (window / 10 = ")
    assert message.endswith("below the minimum resolution of 1 ms): use a window of 10 ms or more, or pass a "
                            "resolution of 1 ms or more that divides the window (resolution='1ms' or 0.001)")
    assert Rule.parse_many("api", rates, resolution="1ms")[0].buckets == round(float(window) * 1000)


def test_an_explicit_resolution_below_1ms_is_named_as_given() -> None:
    with pytest.raises(ConfigError, match=r"^rule 'api': resolution 0.0005s is below the minimum of 1 ms$"):
        Rule("api", 10, 0.01, resolution=0.0005)

"""Rate strings that people already write: the `limits` library's syntax, several limits in one string,
clear refusals, and every place that reads a rate string (TOML rules, proxy routes, the CLI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import limits
import pytest

from geolimit import ConfigError, Limiter, ManualClock, Rule, parse_rate
from geolimit.core.rule import MAX_WINDOW, parse_duration, parse_rates, window_label
from geolimit.core.window import MAX_COUNT
from geolimit.proxy.config import parse_proxy_config
from geolimit.toml_config import parse_rule_groups, parse_rules

#: Strings read by both parsers; each must give the same (limit, window) list, or be refused by both.
SAME = [
    "1/second", "10/minute", "100/hour", "1000/day", "5/month", "12/year",
    "1/seconds", "10/minutes", "100/hours", "1000/days", "5/months", "12/years",
    "1 per second", "10 per minute", "100 per hour", "1000 per day", "5 per month", "12 per year",
    "10per minute", "10 perminute", "10perminute", "10 per2 minutes", "10 per 2minutes", "10per2minutes",
    "10 PER MINUTE", "10 Per Minute", "10/Second", "10/MINUTE", "10/HoUr",
    "10/2 minutes", "10/2minutes", "10 / 2 minutes", " 10/minute ", "10/ minute", "10 /minute", "10\t/\tminute",
    "10/minute\n", "10/minute\u00a0", "\u200910 per minute",
    "5/30 seconds", "3/7 days", "2/3 months", "1/2 years", "100/24 hours", "0/minute", "00010/minute",
    "10/01 minutes",
    "10/hour;5/minute", "10/hour,5/minute", "10/hour|5/minute", "10/hour ; 5/minute", "10/hour , 5/minute",
    "10/hour | 5/minute", "1/second;10/minute;100/hour", "1 per second, 10 per minute", "10/hour;5 per 2 minutes",
    "10/day|1/second",
    # refused by both
    "", "10", "/minute", "ten/minute", "10/", "10/fortnight", "10//minute", "10/per minute", "-1/minute",
    "+1/minute", "1e3/minute", "1.5/minute", "10/hour;", "10/hour;;5/minute", ";10/hour", "10/hour 5/minute",
    "10 minutes", "10/minute/hour", "10/-1 minutes", "10 per per minute", "10/minute;fortnight", "10/0s",
    # ASCII digits and letters only
    "\uff11\uff10/second", "10/\uff11 minutes", "10/\uff53econd", "\u0663/second", "10/m\u00ednute",
    "10/\u212aelvin", "10/w\u212a", "10/\u017fecond", "10 p\u0435r minute",
]
#: Short forms and fractions geolimit reads and `limits` does not.
ONLY_HERE = {
    "10/s": [(10, 1.0)], "10/m": [(10, 60.0)], "10/h": [(10, 3600.0)], "10/d": [(10, 86400.0)],
    "7/250ms": [(7, 0.25)], "10/2m": [(10, 120.0)], "1000/10s": [(1000, 10.0)], "10/mins": [(10, 60.0)],
    "10/hr": [(10, 3600.0)], "10/w": [(10, 604800.0)], "10/week": [(10, 604800.0)], "10/1.5s": [(10, 1.5)],
    "1/.5s": [(1, 0.5)], "10/2.5 minutes": [(10, 150.0)], "5/1mo": [(5, 2592000.0)], "5/2y": [(5, 62208000.0)],
}
#: What `limits` reads but geolimit refuses, and why: a window of 0 (`limits` makes it 1 unit).
ONLY_THERE = ["10/0 seconds", "10/0 minutes", "10/hour;5/minutes;1/0 seconds"]


def theirs(text: str) -> list[tuple[int, float]] | None:
    try:
        return [(item.amount, float(item.get_expiry())) for item in limits.parse_many(text)]
    except ValueError:
        return None


def ours(text: str) -> list[tuple[int, float]] | None:
    try:
        return parse_rates(text)
    except ConfigError:
        return None


def test_the_table_is_broad() -> None:
    table = SAME + list(ONLY_HERE) + ONLY_THERE
    assert len(table) == len(set(table)) >= 100
    accepted_there = [t for t in table if theirs(t) is not None]
    assert [t for t in accepted_there if ours(t) is None] == ONLY_THERE, "all that limits reads but a zero window"


@pytest.mark.parametrize("text", SAME)
def test_same_reading_as_the_limits_library(text: str) -> None:
    assert ours(text) == theirs(text)


@pytest.mark.parametrize(("text", "expected"), ONLY_HERE.items())
def test_short_forms_are_kept(text: str, expected: list[tuple[int, float]]) -> None:
    assert theirs(text) is None
    assert parse_rates(text) == expected


@pytest.mark.parametrize("text", ONLY_THERE)
def test_a_zero_window_must_be_greater_than_zero(text: str) -> None:
    with pytest.raises(ConfigError, match="must be greater than zero"):
        parse_rates(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10/0s", "invalid rate '10/0s': the window '0s' must be greater than zero"),
        ("\uff11\uff10/second", "expected '<count>/<window>'"),
        (f"{MAX_COUNT + 1}/s", f"the count must be at most {MAX_COUNT} \\(2\\*\\*46\\), got {MAX_COUNT + 1}"),
        (f"{2**50}/s", f"the count must be at most {MAX_COUNT} \\(2\\*\\*46\\), got {2**50}"),
        ("9" * 5000 + "/s", "the count must be at most"),
        ("1/99999999 days", f"the window '99999999 days' \\(8.64e\\+12 s\\) is longer than the largest window, "
                            f"{MAX_WINDOW} s \\(100 years of 365 days\\)"),
        ("1/" + "9" * 400 + " days", r"\(inf s\) is longer than the largest window"),
        ("10/hour;5/fortnight", r"invalid rate '10/hour;5/fortnight' \(limit 2 of 2: '5/fortnight'\): the window"),
        ("10/hour;", "limit 2 of 2 is empty"),
    ],
)
def test_refusals_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_rates(text)


def test_the_largest_count_and_window_are_accepted() -> None:
    assert parse_rate(f"{MAX_COUNT}/s") == (MAX_COUNT, 1.0), "2**46 itself is allowed: the bound is inclusive"
    assert parse_rate(f"1/{MAX_WINDOW}s") == (1, float(MAX_WINDOW))
    with pytest.raises(ConfigError, match="largest window"):
        Rule("r", 1, MAX_WINDOW + 1)


def test_the_largest_window_decides_correctly_in_redis(redis_url: str, redis_client: object) -> None:
    clock = ManualClock(1_790_000_000.0)
    rule = Rule.from_string("century", f"2/{MAX_WINDOW}s")
    with Limiter.from_url(redis_url, region="east", rules=[rule], clock=clock) as limiter:
        assert [limiter.hit("century", "u").allowed for _ in range(3)] == [True, True, False]
        clock.advance(MAX_WINDOW / 2)
        denied = limiter.hit("century", "u")
        assert not denied.allowed
        assert 0 < denied.retry_after <= MAX_WINDOW * 1.1 - MAX_WINDOW / 2
        clock.advance(MAX_WINDOW * 0.61)
        assert limiter.hit("century", "u").allowed


def test_one_rate_apis_are_unchanged_and_refuse_several() -> None:
    assert parse_rate("5 per hour") == (5, 3600.0)
    assert Rule.from_string("api", "10per2minutes").window == 120.0
    with pytest.raises(ConfigError, match="holds 2 limits where one is expected"):
        parse_rate("10/hour;5/minute")
    with pytest.raises(ConfigError, match=r"Rule\.parse_many"):
        Rule.from_string("api", "10/hour;5/minute")
    assert parse_duration("2 months") == 2 * 30 * 86400
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration("\uff15s")


def test_parse_many_names_each_rule_after_its_window() -> None:
    rules = Rule.parse_many("api", "10/hour;5/minute|1/250ms", mode="approximate", predict=False)
    assert [(r.name, r.limit, r.window, r.mode, r.predict) for r in rules] == [
        ("api.1h", 10, 3600.0, "approximate", False), ("api.1m", 5, 60.0, "approximate", False),
        ("api.250ms", 1, 0.25, "approximate", False)]
    assert Rule.parse_many("api", "10/hour") == [Rule("api", 10, 3600)], "one rate keeps the name"
    assert [window_label(s) for s in (86400, 2592000, 90, 1.5, 0.25, 120)] == ["1d", "30d", "90s", "1500ms",
                                                                                  "250ms", "2m"]
    with pytest.raises(ConfigError, match=r"two limits over the same window \(1h\)"):
        Rule.parse_many("api", "10/hour;100/60 minutes")


def test_several_rates_are_hit_all_or_nothing(redis_url: str, redis_client: object) -> None:
    clock = ManualClock(1_700_000_000.0)
    rules = Rule.parse_many("api", "3/hour;2/minute")
    with Limiter.from_url(redis_url, region="east", rules=rules, clock=clock) as limiter:
        assert [limiter.hit(rules, "u").allowed for _ in range(3)] == [True, True, False]
        clock.advance(66)  # strict: 11 buckets of 6 s
        assert limiter.hit(rules, "u").allowed
        denied = limiter.hit(rules, "u")
        assert [(r.rule, r.allowed) for r in denied.results] == [("api.1h", False), ("api.1m", True)]


def test_toml_rules_and_proxy_routes_read_several_rates() -> None:
    tables = [{"name": "api", "limit": "10/hour;5 per minute", "resolution": "1s"},
              {"name": "burst", "limit": 2, "window": "1s"}]
    groups = parse_rule_groups(tables, "region.toml")
    assert {name: [r.name for r in rules] for name, rules in groups.items()} == {
        "api": ["api.1h", "api.1m"], "burst": ["burst"]}
    assert [r.resolution for r in parse_rules(tables, "region.toml")] == [1.0, 1.0, 0.1]
    with pytest.raises(ConfigError, match=r"region\.toml: rule 'api': invalid rate '10/hour;5/0s'"):
        parse_rules([{"name": "api", "limit": "10/hour;5/0s"}], "region.toml")
    with pytest.raises(ConfigError, match=r"duplicate rule name 'api\.1m'"):
        parse_rules([tables[0], {"name": "api.1m", "limit": "1/s"}], "region.toml")
    proxy = parse_proxy_config({
        "proxy": {"upstreams": ["http://127.0.0.1:9"], "redis_url": "redis://127.0.0.1:1/0", "region": "a"},
        "rule": tables,
        "route": [{"path": "/api/*", "limits": [{"rule": "api", "key": "header:K", "shadow": True}]},
                  {"path": "/one", "limits": [{"rule": "api.1m"}, {"rule": "burst"}]}],
    })
    assert [(s.rule, s.key.text, s.shadow) for s in proxy.routes[0].limits] == [
        ("api.1h", "header:K", True), ("api.1m", "header:K", True)]
    assert [s.rule for s in proxy.routes[1].limits] == ["api.1m", "burst"]


def test_the_cli_tries_several_rates(redis_url: str, redis_client: object, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "geolimit.cli", "try", "--redis", redis_url, "--times", "4", "5/hour;2/minute", "u"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert [(words[0], words[1]) for words in lines] == [
        ("allowed", "try.1m"), ("allowed", "try.1m"), ("denied", "try.1m"), ("denied", "try.1m")]


def test_the_readme_states_the_largest_window_the_code_accepts() -> None:
    """Once the README said "windows up to 100 years" while `10/101 years` (a year is 360 days) was
    accepted: the cap is 100 years of 365 days."""
    days = MAX_WINDOW // 86400
    assert parse_rates("10/101 years") == [(10, 101 * 360 * 86400.0)]
    with pytest.raises(ConfigError, match="longer than the largest window"):
        parse_rates("10/102 years")
    with pytest.raises(ConfigError, match="longer than the largest window"):
        parse_rates(f"10/{days + 1} days")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"windows up to {days:,} days (100 years of 365 days" in readme
    assert "windows up to 100 years)" not in readme

"""The rate limit service's configuration: envoyproxy/ratelimit's YAML, the TOML keys, every mistake named.

Matching is checked against the examples of envoyproxy/ratelimit's README; errors
must name the file and the path inside it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from geolimit import Rule
from geolimit.errors import ConfigError
from geolimit.server.config import load_config
from geolimit.server.rls.descriptors import RlsConfig, match, parse_rls, subject_of
from geolimit.server.rls.loading import load_rls
from tests.server.helpers import dump_toml, region_config, write_secret


def config(text: str, tmp_path: Path, name: str = "ratelimit.yaml") -> RlsConfig:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load_rls([path])


def refused(text: str, tmp_path: Path) -> str:
    path = tmp_path / "ratelimit.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as info:
        load_rls([path])
    message = str(info.value)
    assert str(path) in message, message
    return message


def limit_of(rls: RlsConfig, domain: str, *entries: tuple[str, str]) -> str | None:
    """The matched limit as 'requests/unit', 'unlimited', or None."""
    found = match(rls.domains[domain], entries)
    if found is None:
        return None
    return "unlimited" if found.rule is None else f"{found.requests_per_unit}/{found.unit}"


def test_matching_follows_the_reference_examples(tmp_path: Path) -> None:
    rls = config("""
        domain: messaging
        descriptors:
          - key: message_type
            value: marketing
            descriptors:
              - key: to_number
                rate_limit: {unit: day, requests_per_unit: 5}
          - key: to_number
            rate_limit: {unit: day, requests_per_unit: 100}
          - key: remote_address
            rate_limit: {unit: second, requests_per_unit: 10}
          - key: remote_address
            value: 50.0.0.5
            rate_limit: {unit: second, requests_per_unit: 0}
          - key: path
            value: /api/*
            rate_limit: {unit: minute, requests_per_unit: 20}
          - key: path
            value: /api/admin
            rate_limit: {unit: minute, requests_per_unit: 1}
          - key: ldap
            rate_limit: {unlimited: true}
          - key: key
            value: value
            rate_limit: {unit: second, requests_per_unit: 300}
        """, tmp_path)
    assert limit_of(rls, "messaging", ("message_type", "marketing"), ("to_number", "1")) == "5/day"
    assert limit_of(rls, "messaging", ("to_number", "1")) == "100/day"
    assert limit_of(rls, "messaging", ("message_type", "marketing")) is None, "a placeholder has no limit"
    assert limit_of(rls, "messaging", ("message_type", "other"), ("to_number", "1")) is None
    assert limit_of(rls, "messaging", ("remote_address", "50.0.0.1")) == "10/second"
    assert limit_of(rls, "messaging", ("remote_address", "50.0.0.5")) == "0/second", "key/value before key"
    assert limit_of(rls, "messaging", ("path", "/api/users")) == "20/minute", "a value ending in * is a prefix"
    assert limit_of(rls, "messaging", ("path", "/api/admin")) == "1/minute", "an exact value beats a wildcard"
    assert limit_of(rls, "messaging", ("path", "/other")) is None
    assert limit_of(rls, "messaging", ("ldap", "x")) == "unlimited"
    assert limit_of(rls, "messaging", ("key", "value"), ("subkey", "subvalue")) is None, "depth must match"
    assert [r.name for r in rls.rules][:2] == ["messaging.message_type_marketing.to_number-per-day",
                                               "messaging.to_number-per-day"]
    assert rls.rules[0] == Rule("messaging.message_type_marketing.to_number-per-day", 5, 86400)
    assert next(r for r in rls.rules if "path_" in r.name).name == "messaging.path__api__-per-minute"


def test_units_are_the_reference_services_and_scalars_are_read_as_written(tmp_path: Path) -> None:
    units = ["second", "minute", "hour", "day", "week", "month", "year"]
    rls = config("domain: d\ndescriptors:\n" + "".join(
        f"  - {{key: k, value: '{u}', rate_limit: {{unit: {u.upper()}, requests_per_unit: '7'}}}}\n" for u in units
    ) + "  - {key: zip, value: 0123, shadow_mode: yes, rate_limit: {unit: hour, requests_per_unit: 1}}\n", tmp_path)
    windows = [r.window for r in rls.rules]
    assert windows == [1, 60, 3600, 86400, 7 * 86400, 30 * 86400, 365 * 86400, 3600]
    assert {r.limit for r in rls.rules} == {7, 1}
    zip_limit = match(rls.domains["d"], [("zip", "0123")])
    assert zip_limit is not None, "0123 stays the string it was written as"
    assert zip_limit.shadow


def test_several_documents_files_and_directories(tmp_path: Path) -> None:
    folder = tmp_path / "ratelimit"
    folder.mkdir()
    (folder / "a.yaml").write_text("domain: a\ndescriptors: [{key: k, rate_limit: {unit: hour, requests_per_unit: 1}}]\n")
    (folder / "b.yml").write_text("domain: b\n---\ndomain: c\ndescriptors:\n  - key: k\n")
    (folder / "notes.txt").write_text("not read")
    rls = load_rls([folder])
    assert sorted(rls.domains) == ["a", "b", "c"]
    assert limit_of(rls, "c", ("k", "v")) is None, "a key without rate_limit or nested descriptors: no limit"
    (folder / "d.yaml").write_text("domain: a\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: domain: 'a' is defined twice \(also in .*a\.yaml\)"):
        load_rls([folder])


@pytest.mark.parametrize(("text", "says"), [
    ("descriptors: []", "domain: a non-empty string is required"),
    ("domain: d\ndescriptor: []", "unknown key descriptor; allowed here: descriptors, domain"),
    ("domain: d\ndescriptors: {key: k}", "descriptors: expected a list of descriptors"),
    ("domain: d\ndescriptors:\n  - value: v", "descriptors[0].key: a non-empty string is required"),
    ("domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: j\n        ratelimit: {}",
     "unknown key descriptors[0].descriptors[0].ratelimit"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minutes, requests_per_unit: 1}",
     "descriptors[0].rate_limit.unit: 'minutes'; use one of second, minute, hour, day, week, month, year"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}", "rate_limit.unit: missing"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour}", "requests_per_unit: missing"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: -1}",
     "requests_per_unit: expected a whole number from 0 to 4294967295, got '-1'"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: hour}", "unlimited rate_limit takes no unit"),
    ("domain: d\ndescriptors:\n  - key: k\n    shadow_mode: maybe", "descriptors[0].shadow_mode: expected true or false"),
    ("domain: d\ndescriptors:\n  - key: k\n  - key: k", "descriptors[1]: duplicate descriptor 'd.k' at this level"),
    ("domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v", "duplicate descriptor 'd.k_v'"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {name: n, unit: hour, requests_per_unit: 1, "
     "replaces: [{name: n}]}", "replaces[0].name: a limit cannot replace itself ('n')"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1, replaces: [n]}",
     "rate_limit.replaces[0]: expected a mapping with name"),
    ("domain: d\ndescriptors: [{key: k, value: [1]}]", "descriptors[0].value: expected a string"),
    ("domain: [d", "invalid YAML"),
    ("", "holds no domain"),
])
def test_mistakes_name_the_file_and_the_path(tmp_path: Path, text: str, says: str) -> None:
    assert says in refused(text, tmp_path)


def test_parse_takes_plain_python_values_too() -> None:
    rls = parse_rls([("<test>", {"domain": "d", "descriptors": [
        {"key": "k", "rate_limit": {"unit": "minute", "requests_per_unit": 3}, "shadow_mode": True}]})])
    found = match(rls.domains["d"], [("k", "x")])
    assert found is not None
    assert (found.requests_per_unit, found.shadow) == (3, True)
    with pytest.raises(ConfigError, match=r"<test>: descriptors\[0\]\.rate_limit\.requests_per_unit"):
        parse_rls([("<test>", {"domain": "d", "descriptors": [{"key": "k", "rate_limit": {
            "unit": "minute", "requests_per_unit": True}}]})])


def test_rule_names_are_valid_unique_and_leave_the_agents_rules_alone() -> None:
    long_value = "v" * 80
    docs: list[tuple[str, object]] = [("<test>", {"domain": "d", "descriptors": [
        {"key": "k", "value": long_value, "rate_limit": {"unit": "hour", "requests_per_unit": 1}},
        {"key": "k", "value": long_value + "w", "rate_limit": {"unit": "hour", "requests_per_unit": 1}},
        {"key": "path", "value": "/a b", "rate_limit": {"unit": "hour", "requests_per_unit": 1}},
        {"key": "path", "value": "/a_b", "rate_limit": {"unit": "hour", "requests_per_unit": 1}},
        {"key": "api", "rate_limit": {"unit": "hour", "requests_per_unit": 1}},
    ]})]
    names = [r.name for r in parse_rls(docs, reserved=["d.api-per-hour"]).rules]
    assert len(set(names)) == 5
    assert all(len(n) <= 64 for n in names)
    assert names[2] == "d.path__a_b-per-hour"
    assert names[3].startswith("d.path__a_b-per-hour-"), "a second '/a_b' gets a digest"
    assert names[4].startswith("d.api-per-hour-"), "the agent's own rule keeps its name"


def test_subjects_keep_every_entry_apart() -> None:
    assert subject_of([("a", "b=c"), ("d", "e")]) == b"a=b%3Dc&d=e"
    assert subject_of([("a", "b"), ("c=d", "e")]) != subject_of([("a", "b&c"), ("d", "e")])
    assert subject_of([("k", "x" * 5000)]).startswith(b"sha256:"), "too long: a digest"


def agent_toml(tmp_path: Path, **region: Any) -> Path:
    write_secret(tmp_path / "gossip.key")
    data = region_config("redis://127.0.0.1:6379/0")
    data["region"] |= region
    path = tmp_path / "region.toml"
    path.write_text(dump_toml(data))
    return path


def test_toml_keys_bare_port_on_loopback_and_no_rule_tables_needed(tmp_path: Path) -> None:
    (tmp_path / "ratelimit.yaml").write_text("domain: d\ndescriptors: [{key: k, rate_limit: {unit: hour, requests_per_unit: 9}}]\n")
    loaded = load_config(agent_toml(tmp_path, rls_listen="8081", rls_config="ratelimit.yaml"))
    assert loaded.rls_listen == ("127.0.0.1", 8081)
    assert loaded.rls is not None
    assert [r.name for r in loaded.rules] == ["api", "d.k-per-hour"], "the descriptors' rules join the agent's"
    assert load_config(agent_toml(tmp_path, rls_listen=8082, rls_config=["ratelimit.yaml"])).rls_listen == ("127.0.0.1", 8082)
    assert load_config(agent_toml(tmp_path, rls_listen="0.0.0.0:8081", rls_config="ratelimit.yaml")).rls_listen == ("0.0.0.0", 8081)
    assert load_config(agent_toml(tmp_path)).rls_listen is None, "off unless asked for"
    assert loaded.rls_fast_path, "the HTTP/2 fast path unless told otherwise"
    assert not load_config(agent_toml(tmp_path, rls_listen="8081", rls_config="ratelimit.yaml",
                                      rls_fast_path=False)).rls_fast_path
    assert loaded.rls_request_timeout == 10.0, "a request's stream must end within 10 s unless told otherwise"
    assert load_config(agent_toml(tmp_path, rls_listen="8081", rls_config="ratelimit.yaml",
                                  rls_request_timeout="2s")).rls_request_timeout == 2.0
    assert loaded.rls_idle_timeout == 3900.0, "an idle connection outlives Envoy's 1 h idle_timeout"
    assert load_config(agent_toml(tmp_path, rls_listen="8081", rls_config="ratelimit.yaml",
                                  rls_idle_timeout="5m")).rls_idle_timeout == 300.0
    data = region_config("redis://127.0.0.1:6379/0")
    del data["rule"]
    data["region"] |= {"rls_listen": "8081", "rls_config": "ratelimit.yaml"}
    (tmp_path / "region.toml").write_text(dump_toml(data))
    assert [r.name for r in load_config(tmp_path / "region.toml").rules] == ["d.k-per-hour"]


@pytest.mark.parametrize(("region", "says"), [
    ({"rls_listen": "8081"}, "region.rls_listen needs region.rls_config"),
    ({"rls_config": "ratelimit.yaml"}, "region.rls_config needs region.rls_listen"),
    ({"rls_listen": "8081", "rls_config": "missing.yaml"}, "region.rls_config: "),
    ({"rls_listen": 70000, "rls_config": "ratelimit.yaml"}, "region.rls_listen: a port from 0 to 65535"),
    ({"rls_listen": "localhost", "rls_config": "ratelimit.yaml"}, "region.rls_listen: expected 'host:port'"),
    ({"rls_listen": "8081", "rls_config": 3}, "region.rls_config must be a file or directory name"),
    ({"rls_fast_path": False}, "region.rls_fast_path needs region.rls_listen and region.rls_config"),
    ({"rls_listen": "8081", "rls_config": "ratelimit.yaml", "rls_fast_path": "yes"},
     "region.rls_fast_path must be a bool"),
    ({"rls_request_timeout": 5}, "region.rls_request_timeout needs region.rls_listen and region.rls_config"),
    ({"rls_listen": "8081", "rls_config": "ratelimit.yaml", "rls_request_timeout": 0},
     "region.rls_request_timeout must be a positive number of seconds"),
    ({"rls_listen": "8081", "rls_config": "ratelimit.yaml", "rls_request_timeout": "10m"},
     "region.rls_request_timeout must be at most 300 seconds, got '10m'"),
    ({"rls_idle_timeout": 60}, "region.rls_idle_timeout needs region.rls_listen and region.rls_config"),
    ({"rls_listen": "8081", "rls_config": "ratelimit.yaml", "rls_idle_timeout": -1},
     "region.rls_idle_timeout must be a positive number of seconds"),
    ({"rls_listen": "8081", "rls_config": "bad.yaml"}, "bad.yaml: descriptors[0].rate_limit.unit: 'fortnight'"),
    ({"rls_listen": "0", "rls_config": "ratelimit.yaml", "workers": 2, "listen": "127.0.0.1:7400"},
     "region.workers = 2 needs a fixed port in region.rls_listen"),
])
def test_toml_mistakes_name_both_files(tmp_path: Path, region: dict[str, Any], says: str) -> None:
    (tmp_path / "ratelimit.yaml").write_text("domain: d\n")
    (tmp_path / "bad.yaml").write_text("domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}]\n")
    path = agent_toml(tmp_path, **region)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert says in str(info.value)
    if "missing" in str(region.get("rls_config")):
        assert "missing.yaml: the rate limit descriptor file does not exist" in str(info.value)

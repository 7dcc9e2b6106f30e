"""The agent's TOML config: what loads, and how every mistake is reported (key and file named)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from geolimit import Rule
from geolimit.errors import ConfigError
from geolimit.server.config import AgentConfig, load_config, with_workers
from tests.server.helpers import dump_toml, make_cert, region_config, write_secret

REDIS = "redis://127.0.0.1:6379/0"  # only parsed here: nothing connects to it
PEERS = [{"name": "b", "url": "http://127.0.0.1:7401"}, {"name": "c", "url": "https://10.0.0.3:7400"}]
RULES = [
    {"name": "api", "limit": "1000/10s", "resolution": 1},
    {"name": "hourly", "limit": 5000, "window": "1h", "resolution": "6m"},
    {"name": "burst", "limit": 20, "window": 2, "mode": "approximate"},
]


@pytest.fixture
def secret(tmp_path: Path) -> bytes:
    return write_secret(tmp_path / "gossip.key")


def valid() -> dict[str, Any]:
    return region_config(REDIS, peers=PEERS, rules=RULES, interval="100ms")


def load(tmp_path: Path, data: dict[str, Any]) -> AgentConfig:
    path = tmp_path / "region.toml"
    path.write_text(dump_toml(data))
    return load_config(path)


def refused(tmp_path: Path, data: dict[str, Any] | str) -> str:
    """The ConfigError message for ``data``; it always names the file."""
    path = tmp_path / "region.toml"
    path.write_text(data if isinstance(data, str) else dump_toml(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_a_valid_file_loads_with_both_limit_forms_and_duration_strings(tmp_path: Path, secret: bytes) -> None:
    data = valid()
    data["region"] |= {"key_prefix": "geo", "shards": 16, "on_error": "deny", "api_listen": "127.0.0.1:7500"}
    data["gossip"] |= {"anti_entropy_interval": "30s", "max_backoff": 5, "timeout": "1500ms",
                       "max_message_bytes": 1 << 20, "outbox_limit": 1000, "auth_window": "1m"}
    data["log"] = {"format": "json", "level": "debug"}
    config = load(tmp_path, data)
    assert config.region == "a"
    assert config.redis_url == REDIS
    assert config.listen == ("127.0.0.1", 0)
    assert config.secret == secret
    assert [(p.name, p.url) for p in config.peers] == [(p["name"], p["url"]) for p in PEERS]
    assert config.rules == (Rule("api", 1000, 10, 1), Rule("hourly", 5000, 3600, 360),
                            Rule("burst", 20, 2, None, "approximate"))
    assert (config.interval, config.anti_entropy_interval, config.timeout, config.auth_window) == (0.1, 30, 1.5, 60)
    assert (config.max_message_bytes, config.outbox_limit, config.max_backoff) == (1 << 20, 1000, 5.0)
    assert (config.key_prefix, config.shards, config.on_error) == ("geo", 16, "deny")
    assert config.api_listen == ("127.0.0.1", 7500)
    assert (config.log_format, config.log_level) == ("json", "DEBUG")
    assert secret.decode() not in repr(config)


def test_relative_files_are_found_next_to_the_config_not_the_cwd(tmp_path: Path, secret: bytes,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path.parent)
    assert load(tmp_path, valid()).secret == secret


def test_redis_cluster_url_and_ipv6_listen(tmp_path: Path, secret: bytes) -> None:
    data = valid()
    data["region"] |= {"redis_url": "redis+cluster://10.0.0.1:7000", "listen": "[::1]:7400"}
    config = load(tmp_path, data)
    assert config.redis_url == "redis+cluster://10.0.0.1:7000"
    assert config.listen == ("::1", 7400)


def test_a_bare_port_listens_on_loopback(tmp_path: Path, secret: bytes) -> None:
    """``listen = 17409`` was refused ("must be a str") while ``rls_listen`` took a bare port."""
    for port in (17409, "17409"):
        data = valid()
        data["region"] |= {"listen": port, "api_listen": 17410}
        config = load(tmp_path, data)
        assert config.listen == ("127.0.0.1", 17409)
        assert config.api_listen == ("127.0.0.1", 17410)
    data = valid()
    data["region"]["listen"] = 70000
    with pytest.raises(ConfigError, match=r"region\.listen: a port from 0 to 65535"):
        load(tmp_path, data)


@pytest.mark.parametrize(("value", "why"), [
    ("::1", "an IPv6 address goes in brackets"),  # read as host ':' and port 1 before
    ("127.0.0.1:\u0668\u0660", "port must be a number"),  # Arabic-Indic digits: int() took them as 80
    ("127.0.0.1:+80", "port must be a number"),
    ("127.0.0.1: 80", "port must be a number"),
    ("127.0.0.1:8_0", "port must be a number"),
])
def test_a_listen_address_is_read_strictly(tmp_path: Path, secret: bytes, value: str, why: str) -> None:
    data = valid()
    data["region"]["listen"] = value
    with pytest.raises(ConfigError, match=why):
        load(tmp_path, data)


def test_an_api_token_file_is_read_and_never_shown(tmp_path: Path, secret: bytes) -> None:
    (tmp_path / "api.token").write_text("tok-" + "x" * 28 + "\n")
    data = valid()
    data["region"]["api_token_file"] = "api.token"
    config = load(tmp_path, data)
    assert config.api_token == "tok-" + "x" * 28
    assert "tok-" not in repr(config)


def _set(data: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    target: Any = data
    for part in path[:-1]:
        target = target.setdefault(part, {}) if isinstance(part, str) else target[part]
    target[path[-1]] = value


UNKNOWN_KEYS = [
    pytest.param(("reigon",), "reigon", id="top-level"),
    pytest.param(("region", "redis"), "region.redis", id="region"),
    pytest.param(("gossip", "intervall"), "gossip.intervall", id="gossip"),
    pytest.param(("gossip", "peers", 0, "adress"), "gossip.peers[0].adress", id="peer"),
    pytest.param(("rule", 1, "burst"), "rule[1].burst", id="rule"),
    pytest.param(("gossip", "tls", "certfile"), "gossip.tls.certfile", id="tls"),
    pytest.param(("log", "colour"), "log.colour", id="log"),
]


@pytest.mark.parametrize(("path", "named"), UNKNOWN_KEYS)
def test_every_unknown_key_is_named(tmp_path: Path, secret: bytes, path: tuple[str | int, ...], named: str) -> None:
    data = valid()
    _set(data, path, "x")
    assert named in refused(tmp_path, data)


MISSING = [
    pytest.param(("region",), "region", id="[region]"),
    pytest.param(("gossip",), "gossip", id="[gossip]"),
    pytest.param(("rule",), "rule", id="[[rule]]"),
    pytest.param(("region", "name"), "region.name", id="region.name"),
    pytest.param(("region", "redis_url"), "region.redis_url", id="region.redis_url"),
    pytest.param(("region", "listen"), "region.listen", id="region.listen"),
    pytest.param(("region", "secret_file"), "region.secret_file", id="region.secret_file"),
    pytest.param(("gossip", "peers", 1, "name"), "gossip.peers[1].name", id="peer.name"),
    pytest.param(("gossip", "peers", 0, "url"), "gossip.peers[0].url", id="peer.url"),
    pytest.param(("rule", 0, "name"), "rule[0].name", id="rule.name"),
    pytest.param(("rule", 0, "limit"), "rule[0].limit", id="rule.limit"),
    pytest.param(("rule", 1, "window"), "window", id="rule.window-with-a-numeric-limit"),
]


@pytest.mark.parametrize(("path", "named"), MISSING)
def test_every_missing_required_key_is_named(tmp_path: Path, secret: bytes, path: tuple[str | int, ...],
                                             named: str) -> None:
    data = valid()
    target: Any = data
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    assert named in refused(tmp_path, data)


def test_a_missing_secret_file_refuses_and_names_it(tmp_path: Path) -> None:
    message = refused(tmp_path, valid())
    assert "region.secret_file" in message
    assert str(tmp_path / "gossip.key") in message


def test_a_short_secret_refuses_without_showing_it(tmp_path: Path) -> None:
    (tmp_path / "gossip.key").write_text("hunter2-secret\n")  # 14 bytes
    message = refused(tmp_path, valid())
    assert str(tmp_path / "gossip.key") in message
    assert "hunter2" not in message
    assert "at least 16" in message


def test_an_unreadable_secret_refuses(tmp_path: Path) -> None:
    key = tmp_path / "gossip.key"
    write_secret(key)
    key.chmod(0)
    try:
        if os.access(key, os.R_OK):  # root reads anything: use a directory instead
            key.chmod(0o600)
            key.unlink()
            key.mkdir()
        assert str(key) in refused(tmp_path, valid())
    finally:
        if key.is_file():
            key.chmod(0o600)


PEER_PROBLEMS = [
    pytest.param({"name": "a", "url": "http://127.0.0.1:7401"}, "own peer", id="own-name"),
    pytest.param({"name": "b", "url": "http://127.0.0.1:7409"}, "duplicate peer 'b'", id="duplicate"),
    pytest.param({"name": "d", "url": "ftp://10.0.0.4:7400"}, "gossip.peers[2].url", id="scheme"),
    pytest.param({"name": "d", "url": "10.0.0.4:7400"}, "gossip.peers[2].url", id="no-scheme"),
    pytest.param({"name": "d", "url": "http://10.0.0.4:port"}, "gossip.peers[2].url", id="bad-port"),
    pytest.param({"name": "d", "url": "http://"}, "gossip.peers[2].url", id="no-host"),
    pytest.param({"name": "d", "url": "http://[::1:7400"}, "gossip.peers[2].url", id="unclosed-ipv6-bracket"),
    pytest.param({"name": "d e", "url": "http://10.0.0.4:7400"}, "gossip.peers[2].name", id="bad-name"),
]


@pytest.mark.parametrize(("peer", "expected"), PEER_PROBLEMS)
def test_peers_are_validated(tmp_path: Path, secret: bytes, peer: dict[str, str], expected: str) -> None:
    data = valid()
    data["gossip"]["peers"].append(peer)
    assert expected in refused(tmp_path, data)


@pytest.mark.parametrize("shards", [16385, 10**11])
def test_a_shard_count_above_the_layouts_limit_is_refused(tmp_path: Path, secret: bytes, shards: int) -> None:
    """Once, region.shards = 10**11 passed the config and the agent died of a MemoryError
    (a traceback) building the list of the shards its worker owns."""
    data = valid()
    data["region"]["shards"] = shards
    message = refused(tmp_path, data)
    assert "region.shards" in message
    assert "16384" in message


def test_invalid_toml_names_the_file(tmp_path: Path, secret: bytes) -> None:
    assert "invalid TOML" in refused(tmp_path, '[region\nname = "a"\n')


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(tmp_path / "nope.toml")
    assert str(tmp_path / "nope.toml") in str(info.value)


BAD_VALUES = [
    pytest.param(("gossip", "interval"), -1, "gossip.interval", id="negative-interval"),
    pytest.param(("gossip", "interval"), 0, "gossip.interval", id="zero-interval"),
    pytest.param(("gossip", "interval"), float("inf"), "gossip.interval", id="infinite-interval"),
    pytest.param(("gossip", "interval"), "soon", "gossip.interval", id="not-a-duration"),
    pytest.param(("gossip", "interval"), 1e-300, "gossip.interval must be between 0.001 s and 3600 s",
                 id="busy-loop-interval"),
    pytest.param(("gossip", "auth_window"), 1e300, "gossip.auth_window must be between 1 s and 3600 s",
                 id="auth-window-of-ages"),
    pytest.param(("gossip", "timeout"), True, "gossip.timeout", id="bool-timeout"),
    pytest.param(("gossip", "outbox_limit"), 0, "gossip.outbox_limit", id="zero-outbox"),
    pytest.param(("gossip", "peers"), "b", "gossip.peers", id="peers-not-a-list"),
    pytest.param(("region", "listen"), "localhost", "region.listen", id="listen-without-port"),
    pytest.param(("region", "listen"), "127.0.0.1:70000", "region.listen", id="listen-port-too-big"),
    pytest.param(("region", "listen"), "127.0.0.1:http", "region.listen", id="listen-port-not-a-number"),
    pytest.param(("region", "listen"), ":7400", "region.listen", id="listen-without-host"),
    pytest.param(("region", "listen"), ["h", 7400], "region.listen: expected 'host:port'", id="listen-not-a-string"),
    pytest.param(("region", "api_listen"), "127.0.0.1:", "region.api_listen", id="api-listen"),
    pytest.param(("region", "name"), "us east", "region.name", id="region-name"),
    pytest.param(("region", "redis_url"), "http://127.0.0.1:6379", "region.redis_url", id="redis-scheme"),
    pytest.param(("region", "on_error"), "ignore", "region.on_error", id="on-error"),
    pytest.param(("region", "shards"), 0, "region.shards", id="shards"),
    pytest.param(("region", "redis_timeout"), 0, "region.redis_timeout", id="zero-redis-timeout"),
    pytest.param(("region", "redis_timeout"), -1.5, "region.redis_timeout", id="negative-redis-timeout"),
    pytest.param(("region", "redis_timeout"), float("nan"), "region.redis_timeout", id="nan-redis-timeout"),
    pytest.param(("region", "redis_timeout"), "quickly", "region.redis_timeout", id="redis-timeout-not-a-duration"),
    pytest.param(("region", "redis_timeout"), True, "region.redis_timeout", id="bool-redis-timeout"),
    pytest.param(("region", "redis_timeout"), 61, "region.redis_timeout must be at most 60 seconds",
                 id="redis-timeout-too-long"),
    pytest.param(("region", "redis_timeout"), "2m", "region.redis_timeout must be at most 60 seconds",
                 id="redis-timeout-duration-too-long"),
    pytest.param(("log", "format"), "xml", "log.format", id="log-format"),
    pytest.param(("log", "level"), "loud", "log.level", id="log-level"),
    pytest.param(("rule", 0, "limit"), "1000 per fortnight", "rule 'api'", id="bad-rate"),
    pytest.param(("rule", 0, "resolution"), 3, "rule 'api'", id="window-not-a-multiple"),
    pytest.param(("rule", 0, "window"), 10, "window is given twice", id="window-twice"),
    pytest.param(("rule", 0, "limit"), -5, "rule 'api'", id="negative-limit"),
    pytest.param(("rule", 0, "mode"), "lenient", "mode", id="mode"),
    pytest.param(("rule", 2, "name"), "api", "duplicate rule name", id="duplicate-rule"),
    pytest.param(("gossip", "tls", "verify_peers"), "yes", "gossip.tls.verify_peers", id="tls-verify"),
    pytest.param(("gossip", "tls", "ca_file"), "missing-ca.pem", "gossip.tls.ca_file", id="tls-missing-file"),
]


@pytest.mark.parametrize(("path", "value", "expected"), BAD_VALUES)
def test_bad_values_are_refused(tmp_path: Path, secret: bytes, path: tuple[str | int, ...], value: object,
                                expected: str) -> None:
    data = valid()
    _set(data, path, value)
    assert expected in refused(tmp_path, data)


@pytest.mark.parametrize(("key", "value"), [("window", -1), ("partition_after", "soon")])
def test_a_bad_rule_duration_names_the_file_and_the_rule_once(tmp_path: Path, secret: bytes, key: str,
                                                              value: object) -> None:
    data = valid()
    data["rule"][2][key] = value
    message = refused(tmp_path, data)
    assert message.startswith(f"{tmp_path / 'region.toml'}: rule 'burst'.{key}")
    assert message.count("region.toml") == 1, message
    assert message.count("rule 'burst'") == 1, message


def test_redis_timeout_defaults_to_one_second(tmp_path: Path, secret: bytes) -> None:
    assert load(tmp_path, valid()).redis_timeout == 1.0


@pytest.mark.parametrize(("value", "seconds"), [(2.5, 2.5), (3, 3.0), ("250ms", 0.25), ("1m", 60.0), (60, 60.0)])
def test_redis_timeout_takes_seconds_or_a_duration(tmp_path: Path, secret: bytes, value: object,
                                                   seconds: float) -> None:
    data = valid()
    data["region"]["redis_timeout"] = value
    config = load(tmp_path, data)
    assert config.redis_timeout == seconds
    assert isinstance(config.redis_timeout, float)


def test_api_listen_cannot_be_the_gossip_address(tmp_path: Path, secret: bytes) -> None:
    data = valid()
    data["region"] |= {"listen": "127.0.0.1:7400", "api_listen": "127.0.0.1:7400"}
    assert "region.api_listen" in refused(tmp_path, data)


@pytest.mark.parametrize("token", ["short", "has a space in it, so no", "é" * 20], ids=["short", "spaces", "non-ascii"])
def test_a_bad_api_token_file_refuses_without_showing_it(tmp_path: Path, secret: bytes, token: str) -> None:
    (tmp_path / "api.token").write_text(token)
    data = valid()
    data["region"]["api_token_file"] = "api.token"
    message = refused(tmp_path, data)
    assert "region.api_token_file" in message
    assert token not in message


def test_tls_files_are_loaded_at_config_time(tmp_path: Path, secret: bytes) -> None:
    cert = make_cert(tmp_path)
    data = valid()
    data["gossip"]["peers"][0]["url"] = "https://127.0.0.1:7401"
    data["gossip"]["tls"] = {"cert_file": cert.cert.name, "key_file": cert.key.name, "ca_file": cert.cert.name}
    tls = load(tmp_path, data).tls
    assert tls is not None
    assert (tls.cert_file, tls.key_file, tls.ca_file, tls.verify_peers) == (cert.cert, cert.key, cert.cert, True)

    broken = copy.deepcopy(data)
    (tmp_path / "garbage.pem").write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    broken["gossip"]["tls"]["cert_file"] = "garbage.pem"
    assert "gossip.tls.cert_file" in refused(tmp_path, broken)

    lonely = copy.deepcopy(data)
    del lonely["gossip"]["tls"]["key_file"]
    assert "key_file" in refused(tmp_path, lonely)


@pytest.mark.parametrize("tls", [{"cert": True}, {"ca": True}], ids=["serving", "client-only"])
def test_tls_with_a_plain_http_peer_is_refused(tmp_path: Path, secret: bytes, tls: dict[str, bool]) -> None:
    """With [gossip.tls], a peer at an http:// URL would get every message in plaintext,
    without a word in the log: refused, naming the peer's url."""
    cert = make_cert(tmp_path)
    data = valid()
    data["gossip"]["tls"] = ({"cert_file": cert.cert.name, "key_file": cert.key.name, "ca_file": cert.cert.name}
                             if "cert" in tls else {"ca_file": cert.cert.name})
    message = refused(tmp_path, data)
    assert "gossip.peers[0].url" in message
    assert "https://" in message
    data["gossip"]["peers"][0]["url"] = "https://127.0.0.1:7401"
    assert load(tmp_path, data).tls is not None


def test_rule_policies_are_parsed(tmp_path: Path) -> None:
    secret = tmp_path / "gossip.key"
    secret.write_text("x" * 32)
    config = tmp_path / "region.toml"
    config.write_text(
        '[region]\nname = "a"\nredis_url = "redis://127.0.0.1:6379/0"\nlisten = "127.0.0.1:7400"\n'
        'secret_file = "gossip.key"\n[gossip]\ninterval = 0.1\n'
        '[[rule]]\nname = "api"\nlimit = "100/10s"\npartition = "share"\npartition_after = "2s"\npredict = false\n'
    )
    (rule,) = load_config(config).rules
    assert (rule.partition, rule.partition_after, rule.predict) == ("share", 2.0, False)
    config.write_text(config.read_text().replace('"share"', '"open"'))
    with pytest.raises(ConfigError, match="partition must be") as info:
        load_config(config)
    assert str(info.value).count("rule 'api'") == 1, "the rule is named once"


def test_workers_default_to_one_and_take_a_fixed_port(tmp_path: Path, secret: bytes) -> None:
    assert load(tmp_path, valid()).workers == 1
    data = valid()
    data["region"] |= {"workers": 4, "listen": "127.0.0.1:7400", "api_listen": "127.0.0.1:7410"}
    assert load(tmp_path, data).workers == 4
    data["region"]["workers"] = 64
    assert load(tmp_path, data).workers == 64


@pytest.mark.parametrize(("region", "expected"), [
    pytest.param({"workers": 0}, "region.workers must be an integer from 1 to 64, got 0", id="zero"),
    pytest.param({"workers": 65}, "region.workers must be an integer from 1 to 64, got 65", id="too-many"),
    pytest.param({"workers": -2}, "region.workers must be an integer from 1 to 64, got -2", id="negative"),
    pytest.param({"workers": True}, "region.workers must be an integer from 1 to 64, got True", id="bool"),
    pytest.param({"workers": "2"}, "region.workers must be an integer from 1 to 64, got '2'", id="string"),
    pytest.param({"workers": 1.5}, "region.workers must be an integer from 1 to 64, got 1.5", id="float"),
    pytest.param({"workers": 8, "shards": 4}, "region.workers = 8 exceeds region.shards = 4", id="more-than-shards"),
    pytest.param({"workers": 2, "listen": "127.0.0.1:0"}, "region.workers = 2 needs a fixed port in region.listen",
                 id="listen-port-0"),
    pytest.param({"workers": 2, "api_listen": "127.0.0.1:0"},
                 "region.workers = 2 needs a fixed port in region.api_listen", id="api-listen-port-0"),
])
def test_bad_workers_are_refused(tmp_path: Path, secret: bytes, region: dict[str, Any], expected: str) -> None:
    data = valid()
    data["region"] |= {"listen": "127.0.0.1:7400"} | region
    assert expected in refused(tmp_path, data)


def test_with_workers_overrides_the_file_and_checks_the_same_way(tmp_path: Path, secret: bytes) -> None:
    data = valid()
    data["region"] |= {"listen": "127.0.0.1:7400", "workers": 2}
    config = load(tmp_path, data)
    assert with_workers(config, 3).workers == 3
    assert with_workers(config, 1).workers == 1
    with pytest.raises(ConfigError, match="--workers must be an integer from 1 to 64, got 0"):
        with_workers(config, 0)
    with pytest.raises(ConfigError, match="--workers = 2 needs a fixed port"):
        with_workers(load(tmp_path, valid()), 2)

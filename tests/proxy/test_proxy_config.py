"""proxy.toml: every key, defaults, and strict errors that name the key and the file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from geolimit.errors import ConfigError
from geolimit.http.keys import CostSpec, KeySpec
from geolimit.proxy import load_proxy_config
from geolimit.proxy.config import __doc__ as CONFIG_DOC
from tests.proxy.helpers import dump_toml


def example() -> str:
    """The complete example in geolimit/proxy/config.py's docstring."""
    assert CONFIG_DOC is not None
    text = CONFIG_DOC.split("::", 1)[1].split('"""', 1)[0]
    return "\n".join(line[4:] for line in text.splitlines())


def test_the_documented_example_parses_with_every_key(tmp_path: Path) -> None:
    (tmp_path / "proxy.toml").write_text(example())
    config = load_proxy_config(tmp_path / "proxy.toml")
    assert config.listen == ("127.0.0.1", 8080)
    assert config.admin_listen == ("127.0.0.1", 8081)
    assert config.upstreams == ("http://127.0.0.1:9000", "http://127.0.0.1:9001")
    assert (config.connect_timeout, config.timeout, config.shutdown_timeout, config.decision_timeout) == (
        5.0, 30.0, 10.0, 1.0)
    assert config.body_timeout == 30.0
    assert (config.retry_connect, config.preserve_host, config.legacy_headers) == (True, False, False)
    assert config.trusted_proxies == ("10.0.0.0/8",)
    assert config.max_body == 10485760
    assert (config.region, config.redis_url, config.agent_url) == ("us-east", "redis://127.0.0.1:6379/0", None)
    assert (config.key_prefix, config.shards) == ("gl", 64)
    assert [r.name for r in config.rules] == ["api"]
    [route] = config.routes
    assert route.route.template == "/api/{version}/*"
    assert route.route.methods == frozenset({"GET", "POST"})
    [limit] = route.limits
    assert (limit.rule, limit.key, limit.cost, limit.shadow, limit.on_error) == (
        "api", KeySpec("ip+header:X-API-Key"), CostSpec(1), False, "allow")
    assert (config.log_format, config.log_level) == ("text", "INFO")


def test_minimal_agent_mode_file_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t" * 32)
    path = tmp_path / "proxy.toml"
    path.write_text(dump_toml({"proxy": {"upstreams": ["http://[::1]:9000/"], "agent_url": "http://127.0.0.1:7400",
                                         "agent_token_file": "token"},
                               "route": [{"path": "/x", "limits": [{"rule": "r", "cost": "header:X-Cost",
                                                                    "shadow": True, "on_error": "deny"}]},
                                         {"path": "/free"}]}))
    config = load_proxy_config(path)
    assert config.upstreams == ("http://[::1]:9000",)
    assert config.agent_token == "t" * 32
    assert config.listen == ("127.0.0.1", 8080), "loopback by default"
    assert config.admin_listen is None
    assert config.max_body is None
    assert config.body_timeout == 30.0, "a request body must arrive within 30 s (+1 s per KiB) by default"
    assert config.routes[0].limits[0].shadow
    assert config.routes[1].limits == ()


BASE: dict[str, Any] = {
    "proxy": {"upstreams": ["http://127.0.0.1:9000"], "redis_url": "redis://127.0.0.1:6379/0", "region": "a"},
    "rule": [{"name": "api", "limit": "5/10s"}],
    "route": [{"path": "/api/*", "limits": [{"rule": "api"}]}],
}


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


CASES = [
    ("proxy.colour", "blue", "unknown key 'proxy.colour'"),
    ("extra", {"a": 1}, "unknown key 'extra'"),
    ("proxy.upstreams", KeyError, "missing key proxy.upstreams"),
    ("proxy.upstreams", [], "proxy.upstreams must list at least one URL"),
    ("proxy.upstreams", ["ftp://x"], "proxy.upstreams[0] must be an http:// or https:// URL"),
    ("proxy.upstreams", ["http://[::1:9000"], "proxy.upstreams[0] must be an http:// or https:// URL"),
    ("proxy.upstreams", ["http://h:1/base"], "proxy.upstreams[0] must be an http:// or https:// URL without a path"),
    ("proxy.upstreams", ["http://h:1", "http://h:1/"], "duplicate upstream"),
    ("proxy.upstreams", "http://h:1", "proxy.upstreams must be a list"),
    ("proxy.listen", "localhost", "proxy.listen: expected 'host:port'"),
    ("proxy.listen", 70000, "proxy.listen: a port from 0 to 65535"),
    ("proxy.admin_listen", "127.0.0.1:8080", "proxy.admin_listen must differ from proxy.listen"),
    ("proxy.timeout", -1, "proxy.timeout must be a positive number of seconds"),
    ("proxy.body_timeout", 0, "proxy.body_timeout must be a positive number of seconds"),
    ("proxy.connect_timeout", "soon", "proxy.connect_timeout"),
    ("proxy.retry_connect", "yes", "proxy.retry_connect must be a bool"),
    ("proxy.trusted_proxies", ["10.0.0.0/33"], "proxy.trusted_proxies: invalid trusted proxy"),
    ("proxy.trusted_proxies", "10.0.0.0/8", "proxy.trusted_proxies must be a list"),
    ("proxy.max_body", 0, "proxy.max_body must be a positive integer"),
    ("proxy.region", KeyError, "missing key proxy.region"),
    ("proxy.region", "bad region!", "proxy.region"),
    ("proxy.redis_url", KeyError, "give exactly one of proxy.redis_url"),
    ("proxy.agent_url", "http://127.0.0.1:7400", "give exactly one of proxy.redis_url"),
    ("proxy.redis_url", "mysql://x", "proxy.redis_url"),
    ("proxy.agent_token_file", "token", "proxy.agent_token_file is only used with proxy.agent_url"),
    ("proxy.shards", 0, "proxy.shards must be an integer from 1 to 16384"),
    ("proxy.shards", 10**11, "proxy.shards must be an integer from 1 to 16384"),
    ("rule", KeyError, "missing key rule"),
    ("rule.0.limit", "lots", "rule 'api'"),
    ("route.0.path", "api", "route[0].path: invalid route 'api'"),
    ("route.0.path", KeyError, "missing key route[0].path"),
    ("route.0.path", "/users/{id}/friends/{id}", "route[0].path: invalid route '/users/{id}/friends/{id}'"),
    ("route.0.verbs", ["GET"], "unknown key 'route[0].verbs'"),
    ("route.0.methods", [], "route[0].methods must be a non-empty list"),
    ("route.0.methods", ["GE T"], "route[0].methods: invalid method"),
    ("route.0.limits", {"rule": "api"}, "route[0].limits must be a list"),
    ("route.0.limits.0.rule", "nope", "route[0].limits[0].rule: unknown rule 'nope'; [[rule]] tables define: api"),
    ("route.0.limits.0.rule", KeyError, "missing key route[0].limits[0].rule"),
    ("route.0.limits.0.key", "cookie:x", "route[0].limits[0].key: invalid key"),
    ("route.0.limits.0.cost", -1, "route[0].limits[0].cost: invalid cost"),
    ("route.0.limits.0.cost", "body-size", "route[0].limits[0].cost: invalid cost"),
    ("route.0.limits.0.shadow", "yes", "route[0].limits[0].shadow must be a bool"),
    ("route.0.limits.0.on_error", "raise", "route[0].limits[0].on_error must be 'allow'"),
    ("route.0.limits.0.weight", 2, "unknown key 'route[0].limits[0].weight'"),
    ("log", {"format": "xml"}, "log.format must be 'text' or 'json'"),
    ("log", {"level": "chatty"}, "log.level must be one of"),
    ("log", {"file": "x"}, "unknown key 'log.file'"),
]


@pytest.mark.parametrize(("where", "value", "message"), CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES])
def test_errors_name_the_key_and_the_file(tmp_path: Path, where: str, value: Any, message: str) -> None:
    data = copy.deepcopy(BASE)
    _set(data, where, value)
    path = tmp_path / "proxy.toml"
    path.write_text(dump_toml(data))
    with pytest.raises(ConfigError) as info:
        load_proxy_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_agent_mode_refuses_rule_tables_and_library_only_keys(tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    data = copy.deepcopy(BASE)
    del data["proxy"]["redis_url"]
    data["proxy"]["agent_url"] = "http://127.0.0.1:7400"
    path.write_text(dump_toml(data))
    with pytest.raises(ConfigError, match=r"in agent mode .* the rules are the agent's"):
        load_proxy_config(path)
    del data["rule"]
    data["proxy"]["shards"] = 8
    path.write_text(dump_toml(data))
    with pytest.raises(ConfigError, match=r"proxy\.shards is only used with proxy\.redis_url"):
        load_proxy_config(path)
    del data["proxy"]["shards"]
    data["proxy"]["agent_token_file"] = "missing.token"
    path.write_text(dump_toml(data))
    with pytest.raises(ConfigError, match=r"proxy\.agent_token_file: cannot read"):
        load_proxy_config(path)

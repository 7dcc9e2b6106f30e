"""Readers of deploy/ shared by the deploy file tests: TOML, compose, Kubernetes, systemd units."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import yaml

from geolimit.core.rule import Rule
from geolimit.toml_config import parse_rules

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
REGIONS = ("us-east", "eu-west", "ap-south")
SERVICES = ("redis", "agent", "app", "proxy")
PAIRS = [(a, b) for i, a in enumerate(REGIONS) for b in REGIONS[i + 1 :]]
SECRETS_DIR = "/run/secrets/"
Data = dict[str, Any]



# -- helpers ---------------------------------------------------------------------------


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


render = load_module("geolimit_deploy_render", DEPLOY / "local" / "render.py")


def toml(path: Path) -> Data:
    data: Data = tomllib.loads(path.read_text(encoding="utf-8"))
    return data


def agent_toml(region: str) -> Data:
    return toml(DEPLOY / "config" / region / "agent.toml")


def proxy_toml(region: str) -> Data:
    return toml(DEPLOY / "config" / region / "proxy.toml")


def compose() -> Data:
    data = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def k8s_documents() -> list[tuple[Path, Data]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def k8s(kind: str, name: str) -> Data:
    found = [doc for _, doc in k8s_documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/kubernetes, found {len(found)}"
    return found[0]


def k8s_config(key: str) -> Data:
    data: Data = tomllib.loads(k8s("ConfigMap", "geolimit-config")["data"][key])
    return data


def port_of(address: str) -> int:
    """The port of 'host:port' or of a URL."""
    if "://" in address:
        port = urlsplit(address).port
        assert port is not None, address
        return port
    return int(address.rpartition(":")[2])


def host_of(address: str) -> str:
    if "://" in address:
        host = urlsplit(address).hostname
        assert host is not None, address
        return host
    return address.rpartition(":")[0]


def plan(region: str) -> dict[str, int]:
    """The region's ports, read from its TOMLs."""
    agent, proxy = agent_toml(region)["region"], proxy_toml(region)["proxy"]
    return {
        "redis": port_of(agent["redis_url"]),
        "gossip": port_of(agent["listen"]),
        "api": port_of(agent["api_listen"]),
        "app": port_of(proxy["upstreams"][0]),
        "proxy": port_of(proxy["listen"]),
        "admin": port_of(proxy["admin_listen"]),
    }


def service_networks(service: Data) -> set[str]:
    networks = service.get("networks", [])
    return set(networks) if isinstance(networks, (list, dict)) else set()


def rules_of(data: Data) -> tuple[Rule, ...]:
    return parse_rules(data["rule"], "<test>")


def walk_strings(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from walk_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_strings(value)


def unit_lines(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a systemd unit, repeated keys kept."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def unit_values(path: Path, key: str) -> list[str]:
    return [value for _, k, value in unit_lines(path) if k == key]


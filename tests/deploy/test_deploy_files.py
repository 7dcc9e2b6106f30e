"""deploy/: every YAML, JSON and TOML file parses, and the files agree with each other.

Ports, host names, region names, secret names and paths, and metric names appear in
several files (compose, region TOMLs, Prometheus, Grafana, systemd, Kubernetes, the
local runner); these tests read them all and cross-check, and load every config with
geolimit's own loaders.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from geolimit.core.rule import Rule
from geolimit.errors import ConfigError
from geolimit.proxy.config import load_proxy_config, parse_proxy_config
from geolimit.proxy.metrics import ProxyMetrics
from geolimit.replication.auth import MIN_SECRET_BYTES
from geolimit.server.config import load_config
from geolimit.server.metrics import AgentMetrics
from geolimit.toml_config import parse_rules
from tests.server.helpers import make_cert

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


# -- every file parses ---------------------------------------------------------------------


def test_every_yaml_json_and_toml_file_in_deploy_parses() -> None:
    counts = {"yaml": 0, "json": 0, "toml": 0}
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix in (".yml", ".yaml"):
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
            assert docs, f"{path} holds no YAML document"
            counts["yaml"] += 1
        elif path.suffix == ".json":
            json.loads(path.read_text())
            counts["json"] += 1
        elif path.suffix == ".toml":
            toml(path)
            counts["toml"] += 1
    assert counts["yaml"] >= 10, counts
    assert counts["json"] >= 1, counts
    assert counts["toml"] == 2 * len(REGIONS), counts
    for key in ("agent.toml", "proxy.toml"):  # embedded TOML
        k8s_config(key)


# -- region TOMLs --------------------------------------------------------------------------


def test_region_names_agree_everywhere() -> None:
    assert sorted(p.name for p in (DEPLOY / "config").iterdir()) == sorted(REGIONS)
    assert render.regions() == list(REGIONS), "render.py orders the regions by port"
    for region in REGIONS:
        assert agent_toml(region)["region"]["name"] == region
        assert proxy_toml(region)["proxy"]["region"] == region
        peers = [p["name"] for p in agent_toml(region)["gossip"]["peers"]]
        assert sorted(peers) == sorted(set(REGIONS) - {region})
    services = compose()["services"]
    assert {f"{s}-{r}" for s in SERVICES for r in REGIONS} <= set(services)
    script = (DEPLOY / "faults" / "partition.sh").read_text()
    assert f'REGIONS="{" ".join(REGIONS)}"' in script


def test_ports_follow_the_plan_and_are_unique() -> None:
    seen: dict[int, str] = {}
    for n, region in enumerate(REGIONS, start=1):
        ports = plan(region)
        assert ports == {"redis": 6380 + n, "gossip": 7400 + n, "api": 7410 + n, "app": 8000 + n,
                         "proxy": 8080 + n, "admin": 9090 + n}, (region, ports)
        for what, port in ports.items():
            assert port not in seen, f"{region} {what} and {seen[port]} share port {port}"
            seen[port] = f"{region} {what}"
        assert proxy_toml(region)["proxy"]["redis_url"] == agent_toml(region)["region"]["redis_url"]
        for peer in agent_toml(region)["gossip"]["peers"]:
            assert peer["url"] == f"http://agent-{peer['name']}:{plan(peer['name'])['gossip']}"
    assert not {9090, 3000} & set(seen), "Prometheus and Grafana have their own ports"


def test_proxies_decide_with_the_agents_rules_and_key_layout() -> None:
    for region in REGIONS:
        agent, proxy = agent_toml(region), proxy_toml(region)
        assert rules_of(proxy) == rules_of(agent) == rules_of(agent_toml(REGIONS[0]))
        for key, default in (("key_prefix", "gl"), ("shards", 64)):
            assert proxy["proxy"].get(key, default) == agent["region"].get(key, default)
        used = {limit["rule"] for route in proxy["route"] for limit in route["limits"]}
        assert used <= {r.name for r in rules_of(agent)}


def test_rendered_configs_load_and_only_addresses_and_secrets_moved(tmp_path: Path) -> None:
    offset = 10000
    render.render(tmp_path, offset, with_proxy=True, check_ports=False)
    secrets_dir = tmp_path / "secrets"
    for name in ("gossip_key", "api_token"):
        secret = (secrets_dir / name).read_bytes().strip()
        assert len(secret) >= MIN_SECRET_BYTES
        assert (secrets_dir / name).stat().st_mode & 0o077 == 0
    hosts = "|".join([f"{s}-{re.escape(r)}" for s in SERVICES for r in REGIONS] + [r"0\.0\.0\.0"])

    def expected(text: str) -> str:
        text = re.sub(rf"\b({hosts}):(\d+)\b", lambda m: f"127.0.0.1:{int(m.group(2)) + offset}", text)
        return text.replace(SECRETS_DIR, f"{secrets_dir}/")

    for region in REGIONS:
        for kind in ("agent", "proxy"):
            source = (DEPLOY / "config" / region / f"{kind}.toml").read_text()
            rendered = (tmp_path / "config" / region / f"{kind}.toml").read_text()
            assert rendered == expected(source)
            assert not re.search(rf"\b({hosts}):", rendered)
        agent = load_config(tmp_path / "config" / region / "agent.toml")
        proxy = load_proxy_config(tmp_path / "config" / region / "proxy.toml")
        ports = plan(region)
        assert agent.listen == ("127.0.0.1", ports["gossip"] + offset)
        assert agent.api_listen == ("127.0.0.1", ports["api"] + offset)
        assert agent.redis_url == proxy.redis_url == f"redis://127.0.0.1:{ports['redis'] + offset}/0"
        assert proxy.listen == ("127.0.0.1", ports["proxy"] + offset)
        assert proxy.admin_listen == ("127.0.0.1", ports["admin"] + offset)
        assert proxy.upstreams == (f"http://127.0.0.1:{ports['app'] + offset}",)
        assert {p.name: p.url for p in agent.peers} == {
            p: f"http://127.0.0.1:{plan(p)['gossip'] + offset}" for p in REGIONS if p != region}
        assert agent.secret == (secrets_dir / "gossip_key").read_bytes().strip()
        assert agent.rules == proxy.rules
    prometheus = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert all(t.startswith("127.0.0.1:") for t in targets), targets
    written = json.loads((tmp_path / "plan.json").read_text())
    assert [r["region"] for r in written["regions"]] == list(REGIONS)


def test_render_refuses_a_taken_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        offset = taken - plan(REGIONS[0])["redis"]  # the first port render checks
        with pytest.raises(render.RenderError, match=f"port 127.0.0.1:{taken} \\(us-east\\) is taken"):
            render.render(tmp_path, offset, with_proxy=True, check_ports=True)


# -- docker-compose.yml --------------------------------------------------------------------


def test_compose_services_match_the_region_configs() -> None:
    data = compose()
    services, secrets = data["services"], data["secrets"]
    published: dict[str, str] = {}
    for region in REGIONS:
        ports = plan(region)
        agent_cfg = agent_toml(region)["region"]
        redis, agent = services[f"redis-{region}"], services[f"agent-{region}"]
        app, proxy = services[f"app-{region}"], services[f"proxy-{region}"]

        assert redis["command"][:3] == ["redis-server", "--port", str(ports["redis"])]
        assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "-p", str(ports["redis"]), "ping"]
        assert host_of(agent_cfg["redis_url"]) == f"redis-{region}"

        assert agent["command"] == ["agent", "--config", "/etc/geolimit/agent.toml"]
        assert proxy["command"] == ["proxy", "--config", "/etc/geolimit/proxy.toml"]
        for service in (agent, proxy):
            assert service["volumes"] == [f"./config/{region}:/etc/geolimit:ro"]
        assert agent["container_name"] == f"geolimit-agent-{region}"
        assert sorted(agent["ports"]) == sorted(f"127.0.0.1:{p}:{p}" for p in (ports["gossip"], ports["api"]))
        assert sorted(proxy["ports"]) == sorted(f"127.0.0.1:{p}:{p}" for p in (ports["proxy"], ports["admin"]))
        for entry in agent["ports"] + proxy["ports"]:
            host_port = entry.rsplit(":", 1)[0]
            assert host_port not in published, f"{entry} is published twice"
            published[host_port] = region

        # Health checks hit the right port of the right process.
        assert agent["environment"]["GEOLIMIT_HEALTHCHECK_URL"] == f"http://127.0.0.1:{ports['gossip']}/healthz"
        assert proxy["environment"]["GEOLIMIT_HEALTHCHECK_URL"] == f"http://127.0.0.1:{ports['admin']}/healthz"
        assert app["environment"]["GEOLIMIT_HEALTHCHECK_URL"] == f"http://127.0.0.1:{ports['app']}/healthz"

        # The sample app listens where the proxy sends requests.
        upstream = proxy_toml(region)["proxy"]["upstreams"][0]
        assert host_of(upstream) == f"app-{region}"
        assert app["command"] == ["--listen", f"0.0.0.0:{ports['app']}", "--region", region]
        assert app["entrypoint"] == ["python", "/srv/app/app.py"]
        assert app["volumes"] == ["./app:/srv/app:ro"]

        # Whoever names a host shares a network with it.
        links = {f"link-{a}-{b}" for a, b in PAIRS if region in (a, b)}
        assert service_networks(agent) == {region} | links
        for name in (f"redis-{region}", f"app-{region}", f"proxy-{region}"):
            assert service_networks(services[name]) == {region}
        for peer in agent_toml(region)["gossip"]["peers"]:
            shared = service_networks(agent) & service_networks(services[f"agent-{peer['name']}"])
            assert shared == {f"link-{min(region, peer['name'], key=REGIONS.index)}-"
                              f"{max(region, peer['name'], key=REGIONS.index)}"}
        assert set(proxy["depends_on"]) == {f"redis-{region}", f"agent-{region}", f"app-{region}"}

        # Secrets: what the agent's TOML reads is what compose mounts.
        files = [agent_cfg["secret_file"], agent_cfg["api_token_file"]]
        assert all(f.startswith(SECRETS_DIR) for f in files)
        assert sorted(agent["secrets"]) == sorted(f[len(SECRETS_DIR):] for f in files)
        assert "secrets" not in proxy, "library-mode proxies need no secret"
    for name, spec in secrets.items():
        assert spec == {"file": f"./secrets/{name}"}
    assert set(secrets) == {"gossip_key", "api_token"}


def test_compose_paths_exist_and_the_image_builds_from_the_dockerfile() -> None:
    data = compose()
    for name, service in data["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
        build = service.get("build")
        if build is not None:
            assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
            assert service["image"] == "geolimit:0.1.0"
            assert service["read_only"] is True
            assert service["cap_drop"] == ["ALL"]
    assert data["name"] == "geolimit"
    assert data["services"]["faults"]["profiles"] == ["faults"]


def test_prometheus_scrapes_every_agent_and_proxy_with_its_region() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"geolimit-agent", "geolimit-proxy"}
    for job, service, port in (("geolimit-agent", "agent", "gossip"), ("geolimit-proxy", "proxy", "admin")):
        assert jobs[job]["metrics_path"] == "/metrics"
        found = {(t, sc["labels"]["region"]) for sc in jobs[job]["static_configs"] for t in sc["targets"]}
        assert found == {(f"{service}-{r}:{plan(r)[port]}", r) for r in REGIONS}
    services = compose()["services"]
    prometheus = services["prometheus"]
    assert prometheus["volumes"] == ["./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"]
    for region in REGIONS:  # on every region's network: a partitioned region is still scraped
        assert region in service_networks(prometheus)
        assert not any(n.startswith("link-") for n in service_networks(prometheus))


# -- Grafana -------------------------------------------------------------------------------


def exposed_metric_names() -> set[str]:
    """Every sample name the agent and the proxy can expose (counters get _total)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    families = [(m.name, m.type) for m in AgentMetrics(lambda: None).registry.collect()]
    families += [(m.name, m.type) for m in ProxyMetrics().registry.collect()]
    # The gossip engine's families are made at scrape time: read their names from the collector.
    source = (ROOT / "geolimit" / "server" / "metrics.py").read_text()
    for kind, name in re.findall(r'(Gauge|Counter)MetricFamily\(\s*"(geolimit_\w+)"', source):
        families.append((name, kind.lower()))
    for name, kind in families:
        names.update(name + s for s in suffixes[kind])
    return names


def dashboard() -> Data:
    data = json.loads((DEPLOY / "grafana" / "geolimit-dashboard.json").read_text())
    assert isinstance(data, dict)
    return data


def panel_exprs() -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in dashboard()["panels"]}


def test_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    exposed = exposed_metric_names()
    assert {"geolimit_peer_lag_seconds", "geolimit_gossip_cells_sent_total"} <= exposed
    used = {name for expr in walk_strings(dashboard()) for name in re.findall(r"\bgeolimit_[a-z0-9_]+\b", expr)}
    assert used, "the dashboard queries nothing"
    assert sorted(used - exposed) == [], "the dashboard queries metrics nobody exposes"
    engine_families = {"geolimit_peer_lag_seconds", "geolimit_outbox_cells", "geolimit_peer_contact_age_seconds",
                       "geolimit_gossip_round_seconds_bucket", "geolimit_gossip_rejected_total",
                       "geolimit_decisions_total", "geolimit_proxy_decisions_total"}
    assert engine_families <= used


def test_grafana_dashboard_charts_decisions_denials_lag_outboxes_contact_rounds_rejections_and_rtt() -> None:
    exprs = panel_exprs()
    joined = {title: " ".join(e) for title, e in exprs.items()}

    def panels_with(*needles: str) -> list[str]:
        return [t for t, e in joined.items() if all(n in e for n in needles)]

    assert panels_with("geolimit_proxy_decisions_total", "rule, result")
    assert panels_with("geolimit_decisions_total", "rule, result")
    assert panels_with('result="denied"')
    assert panels_with("geolimit_peer_lag_seconds", "peer")
    assert panels_with("geolimit_outbox_cells", "peer")
    assert panels_with("geolimit_peer_contact_age_seconds")
    assert panels_with("geolimit_gossip_round_seconds_bucket")
    assert panels_with("geolimit_gossip_rejected_total", "reason")
    assert panels_with("geolimit_peer_rtt_seconds", "peer")
    data = dashboard()
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for p in data["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all('region=~"$region"' in t["expr"] for t in p["targets"]), p["title"]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "region" in variables["region"]["definition"]


def test_grafana_provisioning_matches_compose() -> None:
    grafana = compose()["services"]["grafana"]
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/geolimit.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./grafana/geolimit-dashboard.json"] == f"{folder}/geolimit-dashboard.json"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{folder}/geolimit-dashboard.json"
    assert set(compose()["services"]["prometheus"]["networks"]) & set(grafana["networks"])


# -- Kubernetes ------------------------------------------------------------------------------


def pod_spec(name: str) -> Data:
    spec = k8s("Deployment", name)["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def container_ports(name: str) -> dict[str, int]:
    (container,) = pod_spec(name)["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_kubernetes_resources_are_consistent() -> None:
    docs = k8s_documents()
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")}
    assert set(kustomization["resources"]) == files - {"kustomization.yaml", "secret.yaml"}
    namespace = k8s("Namespace", "geolimit")["metadata"]["name"]
    assert kustomization["namespace"] == namespace
    for path, doc in docs:
        if doc["kind"] not in ("Namespace", "Kustomization"):
            assert doc["metadata"]["namespace"] == namespace, f"{path.name}: {doc['kind']} {doc['metadata']['name']}"
    deployments = {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == "Deployment"}
    assert set(deployments) == {"geolimit-redis", "geolimit-agent", "geolimit-proxy"}
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        spec = pod_spec(name)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["readOnlyRootFilesystem"] is True
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert "memory" in container["resources"]["limits"]
            names = {p["name"] for p in container["ports"]}
            for probe in ("livenessProbe", "readinessProbe"):
                check = container[probe].get("httpGet") or container[probe].get("tcpSocket") or {}
                if "port" in check:
                    assert check["port"] in names, f"{name} {probe} names a port the container lacks"
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
    # Services select pods of a Deployment and target ports those pods name.
    for _, doc in docs:
        if doc["kind"] != "Service":
            continue
        selector = doc["spec"]["selector"]
        owners = [d for d in deployments.values()
                  if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(owners) == 1, doc["metadata"]["name"]
        ports = container_ports(owners[0]["metadata"]["name"])
        for port in doc["spec"]["ports"]:
            assert port["targetPort"] in ports, (doc["metadata"]["name"], port)
    images = {c["image"] for n in ("geolimit-agent", "geolimit-proxy") for c in pod_spec(n)["containers"]}
    assert images == {f"{kustomization['images'][0]['name']}:{kustomization['images'][0]['newTag']}"}
    agent = k8s("Deployment", "geolimit-agent")["spec"]
    assert agent["replicas"] == 1, "one agent per region"
    assert agent["strategy"] == {"type": "Recreate"}, "never two agents of a region at once"
    assert k8s("Service", "geolimit-gossip")["spec"]["type"] == "LoadBalancer"


def test_kubernetes_probes_and_ports_match_the_configmap() -> None:
    agent, proxy = k8s_config("agent.toml")["region"], k8s_config("proxy.toml")["proxy"]
    agent_ports, proxy_ports = container_ports("geolimit-agent"), container_ports("geolimit-proxy")
    assert agent_ports == {"gossip": port_of(agent["listen"]), "api": port_of(agent["api_listen"])}
    assert proxy_ports == {"http": port_of(proxy["listen"]), "admin": port_of(proxy["admin_listen"])}
    assert agent_ports == {"gossip": plan("us-east")["gossip"], "api": plan("us-east")["api"]}
    for name, port_name in (("geolimit-agent", "api"), ("geolimit-proxy", "admin")):
        (container,) = pod_spec(name)["containers"]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port_name}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port_name}
        assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": port_name}
        port = agent_ports[port_name] if name == "geolimit-agent" else proxy_ports[port_name]
        assert {"name": "GEOLIMIT_HEALTHCHECK_URL", "value": f"http://127.0.0.1:{port}/healthz"} in container["env"]
        assert container["args"] == [name.split("-")[1], "--config", f"/etc/geolimit/{name.split('-')[1]}.toml"]
    redis_port = container_ports("geolimit-redis")["redis"]
    service = k8s("Service", "geolimit-redis")
    for url in (agent["redis_url"], proxy["redis_url"]):
        assert (host_of(url), port_of(url)) == (service["metadata"]["name"], redis_port)
    assert service["spec"]["ports"][0]["port"] == redis_port
    annotations = k8s("Deployment", "geolimit-agent")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(agent_ports["api"])


def test_kubernetes_secrets_and_configs_line_up(tmp_path: Path) -> None:
    agent_text = k8s("ConfigMap", "geolimit-config")["data"]["agent.toml"]
    agent = tomllib.loads(agent_text)
    secret = k8s("Secret", "geolimit-secrets")
    spec = pod_spec("geolimit-agent")
    (container,) = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # Secrets: mounted where the TOML reads them, under the keys the Secret has.
    for key in ("secret_file", "api_token_file"):
        path = agent["region"][key]
        directory, _, filename = path.rpartition("/")
        (volume,) = [n for n, v in volumes.items() if "secret" in v and mounts.get(n) == directory]
        items = {i["path"]: i["key"] for i in volumes[volume]["secret"]["items"]}
        assert volumes[volume]["secret"]["secretName"] == secret["metadata"]["name"]
        assert items[filename] in secret["stringData"]
    tls = agent["gossip"]["tls"]
    assert {p.rpartition("/")[0] for p in (tls["cert_file"], tls["key_file"], tls["ca_file"])} == {mounts["tls"]}
    assert volumes["tls"]["secret"]["secretName"] == "geolimit-gossip-tls"
    assert volumes["config"]["configMap"]["name"] == "geolimit-config"
    assert mounts["config"] == "/etc/geolimit"
    # Placeholders only, too short for the agent: it refuses them instead of running insecurely.
    assert set(secret["stringData"].values()) == {"CHANGE-ME"}
    assert all(len(v.encode()) < MIN_SECRET_BYTES for v in secret["stringData"].values())
    # The ConfigMap's files load, with the secret and TLS files where the pod would have them.
    cert = make_cert(tmp_path)
    (tmp_path / "gossip_key").write_text("CHANGE-ME\n")
    (tmp_path / "api_token").write_text(os.urandom(24).hex() + "\n")
    text = agent_text.replace(SECRETS_DIR, f"{tmp_path}/")
    text = text.replace(tls["cert_file"], str(cert.cert)).replace(tls["key_file"], str(cert.key))
    text = text.replace(tls["ca_file"], str(cert.cert))
    (tmp_path / "agent.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"region\.secret_file"):
        load_config(tmp_path / "agent.toml")
    (tmp_path / "gossip_key").write_text(os.urandom(32).hex() + "\n")
    loaded = load_config(tmp_path / "agent.toml")
    assert loaded.region == "us-east"
    assert loaded.tls is not None
    assert sorted(p.name for p in loaded.peers) == ["ap-south", "eu-west"]
    assert all(p.url.startswith("https://") for p in loaded.peers), "gossip between clusters uses TLS"
    assert loaded.rules == rules_of(agent_toml("us-east")), "the rules are deploy/config's"
    proxy = parse_proxy_config(k8s_config("proxy.toml"))
    assert proxy.region == "us-east"
    assert proxy.rules == loaded.rules
    proxy_mounts = pod_spec("geolimit-proxy")["containers"][0]["volumeMounts"]
    assert [m["name"] for m in proxy_mounts] == ["config"], "library-mode proxies need no secret"


# -- secrets ---------------------------------------------------------------------------------


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)


def test_no_secret_is_committed_and_generated_ones_are_ignored(tmp_path: Path) -> None:
    tracked = git("ls-files", "deploy/secrets").stdout.split()
    assert set(tracked) <= {"deploy/secrets/.gitignore", "deploy/secrets/generate.sh"}
    for name in ("gossip_key", "api_token"):
        assert git("check-ignore", "-q", f"deploy/secrets/{name}").returncode == 0, f"{name} is not git-ignored"
    for path in DEPLOY.rglob("*"):
        if path.is_file() and "secrets" not in path.parts:
            assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), path
    # generate.sh makes what compose mounts: readable by the container's user, 32 random bytes.
    folder = tmp_path / "secrets"
    folder.mkdir()
    shutil.copy(DEPLOY / "secrets" / "generate.sh", folder)
    done = subprocess.run(["sh", str(folder / "generate.sh")], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    first = {}
    for name in compose()["secrets"]:
        path = folder / name
        first[name] = path.read_bytes()
        assert len(first[name].strip()) >= 40
        assert path.stat().st_mode & 0o777 == 0o644
    assert folder.stat().st_mode & 0o777 == 0o700
    again = subprocess.run(["sh", str(folder / "generate.sh")], capture_output=True, text=True, timeout=30, check=False)
    assert again.returncode == 0, again.stderr
    assert all((folder / n).read_bytes() == v for n, v in first.items()), "existing secrets are kept"


# -- fault injection -------------------------------------------------------------------------


def test_fault_script_drives_the_compose_networks(tmp_path: Path) -> None:
    script = DEPLOY / "faults" / "partition.sh"
    prefix = re.search(r"^PREFIX=(\S+)", script.read_text(), re.MULTILINE)
    assert prefix is not None
    assert prefix.group(1) == compose()["name"]
    networks = {spec["name"] for spec in compose()["networks"].values()}
    for a, b in PAIRS:
        assert f"geolimit-link-{a}-{b}" in networks
    # A stand-in docker CLI: records the calls; every agent is on every link.
    calls = tmp_path / "calls"
    agents = " ".join(f"geolimit-agent-{r}" for r in REGIONS)
    fake = tmp_path / "docker"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(calls))}\n'
                    f'[ "$1 $2" = "network inspect" ] && echo "{agents} "\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(script), *args], env=env, capture_output=True, text=True, timeout=30,
                              check=False)

    done = run("isolate", "ap-south")
    assert done.returncode == 0, done.stderr
    disconnects = [c for c in calls.read_text().splitlines() if c.startswith("network disconnect")]
    assert sorted(disconnects) == sorted(
        f"network disconnect geolimit-link-{a}-{b} geolimit-agent-{r}"
        for a, b in PAIRS if "ap-south" in (a, b) for r in (a, b))
    containers = {s.get("container_name") for s in compose()["services"].values()}
    assert {c.split()[2] for c in disconnects} <= networks
    assert {c.split()[3] for c in disconnects} <= containers
    bad = run("cut", "us-east", "mars")
    assert bad.returncode == 2
    assert "unknown region 'mars'" in bad.stderr


# -- systemd ---------------------------------------------------------------------------------

HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "PrivateDevices": "yes", "CapabilityBoundingSet": "", "DynamicUser": "yes", "RestrictSUIDSGID": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "ReadOnlyPaths": "/etc/geolimit",
    "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "LockPersonality": "yes",
    "SystemCallArchitectures": "native", "Restart": "on-failure", "ExecReload": "/bin/kill -HUP $MAINPID",
}


@pytest.mark.parametrize("kind", ["agent", "proxy"])
def test_systemd_unit_is_hardened_and_reads_the_configs_paths(kind: str) -> None:
    unit = DEPLOY / "systemd" / f"geolimit-{kind}@.service"
    for key, value in HARDENING.items():
        assert unit_values(unit, key) == [value], key
    assert unit_values(unit, "ExecStart") == [f"/opt/geolimit/bin/geolimit {kind} --config /etc/geolimit/%i/{kind}.toml"]
    # Credentials appear at the /run/secrets paths the TOML names (the same files as compose).
    loaded = {v.split(":")[0]: v.split(":")[1] for v in unit_values(unit, "LoadCredential")}
    bound = {v.split(":")[1]: v.split(":")[0] for v in unit_values(unit, "BindReadOnlyPaths")}
    assert bound == {f"{SECRETS_DIR}{name}": f"%d/{name}" for name in loaded}
    for path in loaded.values():
        assert path.startswith("/etc/geolimit/secrets/")
    assert unit_values(unit, "InaccessiblePaths") == ["-/etc/geolimit/secrets"]
    config = agent_toml("us-east")["region"] if kind == "agent" else {}
    wanted = {config[k] for k in ("secret_file", "api_token_file") if k in config}
    assert set(bound) == wanted


def test_systemd_units_verify_and_rate_ok(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("this test needs systemd-analyze (apt-get install systemd)", pytrace=False)
    for kind in ("agent", "proxy"):
        text = (DEPLOY / "systemd" / f"geolimit-{kind}@.service").read_text()
        # verify checks that ExecStart's program exists: the venv's geolimit is not at /opt here.
        instance = tmp_path / f"geolimit-{kind}@us-east.service"
        instance.write_text(text.replace("/opt/geolimit/bin/geolimit", "/bin/true"))
        done = subprocess.run([analyze, "verify", "--man=no", str(instance)], capture_output=True, text=True,
                              timeout=60, check=False)
        assert (done.returncode, done.stdout + done.stderr) == (0, ""), done.stderr
        security = subprocess.run([analyze, "security", "--offline=yes", str(instance)], capture_output=True,
                                  text=True, timeout=60, check=False)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
        assert found is not None, security.stdout + security.stderr
        assert float(found.group(1)) <= 2.0, security.stdout


# -- Dockerfile and scripts ------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_with_entrypoint_and_healthcheck() -> None:
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) >= 2
    assert all(" AS " in s for s in stages)
    final = lines[lines.index(stages[-1]):]
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users
    assert users[-1].split(":")[0] not in ("0", "root")
    assert int(users[-1].split(":")[0]) == pod_spec("geolimit-agent")["securityContext"]["runAsUser"]
    entrypoint = [line for line in final if line.startswith("ENTRYPOINT ")]
    assert [json.loads(line[len("ENTRYPOINT "):]) for line in entrypoint] == [["geolimit"]]
    assert toml(ROOT / "pyproject.toml")["project"]["scripts"]["geolimit"] == "geolimit.cli:main"
    text = (DEPLOY / "Dockerfile").read_text()
    assert "GEOLIMIT_HEALTHCHECK_URL" in text
    assert any(line.startswith("HEALTHCHECK ") for line in final)
    # What the build copies from the context exists and is not excluded by the .dockerignore.
    copied = {src for line in lines if line.startswith("COPY ") and "--from=" not in line
              for src in line.split()[1:-1]}
    assert copied == {"pyproject.toml", "README.md", "geolimit"}
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore
    for source in copied:
        assert (ROOT / source).exists()
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is excluded from the build context"


def test_scripts_are_syntactically_valid_and_executable() -> None:
    for script, shell in (("local/run.sh", "bash"), ("faults/partition.sh", "sh"), ("secrets/generate.sh", "sh")):
        path = DEPLOY / script
        done = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, f"{script}: {done.stderr}"
        assert os.access(path, os.X_OK), f"{script} is not executable"
    for script in ("local/render.py", "local/smoke.py", "app/app.py"):
        compile((DEPLOY / script).read_text(), script, "exec")

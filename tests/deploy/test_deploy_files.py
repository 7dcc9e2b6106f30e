"""deploy/: every YAML, JSON and TOML file parses, and the region configs, compose, Prometheus
and Grafana agree with each other and with geolimit's own loaders (Kubernetes, systemd, secrets
and scripts: test_deploy_platforms.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from geolimit.proxy.config import load_proxy_config
from geolimit.proxy.metrics import ProxyMetrics
from geolimit.replication.auth import MIN_SECRET_BYTES
from geolimit.server.config import load_config
from geolimit.server.metrics import AgentMetrics

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass


from tests.deploy.deploy_support import (
    DEPLOY,
    PAIRS,
    REGIONS,
    ROOT,
    SECRETS_DIR,
    SERVICES,
    Data,
    agent_toml,
    compose,
    host_of,
    k8s_config,
    plan,
    proxy_toml,
    render,
    rules_of,
    service_networks,
    toml,
    walk_strings,
)

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



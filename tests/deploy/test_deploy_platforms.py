"""deploy/: Kubernetes, secrets, fault injection, systemd units, the Dockerfile and scripts agree
with the region configs and with each other (the configs themselves: test_deploy_files.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from geolimit.errors import ConfigError
from geolimit.proxy.config import parse_proxy_config
from geolimit.replication.auth import MIN_SECRET_BYTES
from geolimit.server.config import load_config
from tests.server.helpers import make_cert

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


from tests.deploy.deploy_support import (
    DEPLOY,
    PAIRS,
    REGIONS,
    ROOT,
    SECRETS_DIR,
    Data,
    agent_toml,
    compose,
    host_of,
    k8s,
    k8s_config,
    k8s_documents,
    plan,
    port_of,
    rules_of,
    toml,
    unit_values,
)

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

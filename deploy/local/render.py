#!/usr/bin/env python3
"""Render deploy/config for one machine: the same files docker-compose uses, moved to loopback.

    python deploy/local/render.py --state DIR [--offset N] [--no-proxy]

Writes, under DIR:

* ``config/<region>/agent.toml`` and ``proxy.toml``: deploy/config/<region>/*.toml with
  three text substitutions and nothing else (comments and all stay):

  1. ``HOST:PORT`` where HOST is a service of the layout (``redis-<region>``,
     ``agent-<region>``, ``proxy-<region>``, ``app-<region>``) or ``0.0.0.0``
     becomes ``127.0.0.1:<PORT + offset>``;
  2. ``/run/secrets/`` (where compose, Kubernetes and the systemd units put the
     secrets) becomes ``DIR/secrets/``;
  3. nothing else: every port of the layout is unique across the three regions,
     so the compose numbers work unchanged on one machine (offset 0).

* ``prometheus.yml``: deploy/prometheus/prometheus.yml, same substitutions (point a
  local Prometheus at it to scrape the local layout);
* ``secrets/gossip_key`` and ``secrets/api_token``: fresh random values (mode 0600),
  unless they already exist;
* ``plan.json`` and ``plan.tsv``: what run.sh starts, read back from the rendered files
  (the only source of addresses is the configs).

Every rendered agent config is loaded with geolimit's own loader (and every proxy
config with the proxy's, unless --no-proxy), and every port must be free: a problem
is reported before anything starts. Exit status: 0, or 2 with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parent.parent
SERVICES = ("redis", "agent", "proxy", "app")
SECRETS = ("gossip_key", "api_token")
SECRETS_DIR = "/run/secrets/"


class RenderError(Exception):
    pass


def regions(config_dir: Path = DEPLOY / "config") -> list[str]:
    """Region names: the folders of deploy/config that hold an agent.toml, in port order."""
    found = [p.parent.name for p in config_dir.glob("*/agent.toml")]
    if not found:
        raise RenderError(f"no <region>/agent.toml under {config_dir}")

    def port(name: str) -> int:
        data = tomllib.loads((config_dir / name / "agent.toml").read_text(encoding="utf-8"))
        return int(str(data["region"]["listen"]).rpartition(":")[2])

    return sorted(found, key=port)


def address_pattern(names: list[str]) -> re.Pattern[str]:
    hosts = [f"{service}-{re.escape(name)}" for service in SERVICES for name in names] + [r"0\.0\.0\.0"]
    return re.compile(r"(?<![\w.-])(" + "|".join(hosts) + r"):(\d{1,5})(?!\d)")


def render_text(text: str, names: list[str], offset: int, secrets_dir: Path) -> str:
    """The substitutions of the module docstring."""

    def local(match: re.Match[str]) -> str:
        port = int(match.group(2)) + offset
        if not 0 < port < 65536:
            raise RenderError(f"{match.group(0)} + offset {offset} is not a valid port")
        return f"127.0.0.1:{port}"

    text = address_pattern(names).sub(local, text)
    return text.replace(SECRETS_DIR, str(secrets_dir) + "/")


def write_secrets(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for name in SECRETS:
        path = directory / name
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")


def host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def url_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise RenderError(f"{url!r} needs an explicit host and port")
    return parts.hostname, parts.port


def load_proxy(path: Path) -> None:
    """Validate a proxy config with the proxy's own loader."""
    try:
        from geolimit.proxy.config import load_proxy_config
    except ImportError as exc:
        raise RenderError(
            f"cannot validate {path}: the proxy is not installed ({exc}); run with --no-proxy"
        ) from None
    load_proxy_config(path)


def plan_region(name: str, agent: dict[str, Any], proxy: dict[str, Any]) -> dict[str, Any]:
    region = agent["region"]
    redis_host, redis_port = url_port(region["redis_url"])
    api_host, api_port = host_port(region.get("api_listen", region["listen"]))
    gossip_host, gossip_port = host_port(region["listen"])
    entry: dict[str, Any] = {
        "region": name,
        "redis_host": redis_host,
        "redis_port": redis_port,
        "agent_url": f"http://{gossip_host}:{gossip_port}",
        "api_url": f"http://{api_host}:{api_port}",
        "ports": [redis_port, gossip_port, api_port],
    }
    section = proxy["proxy"]
    upstream = section["upstreams"][0]
    app_host, app_port = url_port(upstream)
    proxy_host, proxy_port = host_port(section["listen"])
    admin_host, admin_port = host_port(section["admin_listen"])
    entry.update(
        app_host=app_host,
        app_port=app_port,
        proxy_url=f"http://{proxy_host}:{proxy_port}",
        admin_url=f"http://{admin_host}:{admin_port}",
    )
    entry["ports"] += [app_port, proxy_port, admin_port]
    return entry


def check_ports_free(plan: list[dict[str, Any]], with_proxy: bool) -> None:
    for entry in plan:
        ports = entry["ports"] if with_proxy else entry["ports"][:4]
        for port in ports:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError as exc:
                    raise RenderError(
                        f"port 127.0.0.1:{port} ({entry['region']}) is taken ({exc.strerror}): is another "
                        f"run.sh up still running (run.sh down), or pick other ports with --offset"
                    ) from None


def render(state: Path, offset: int = 0, with_proxy: bool = True, check_ports: bool = True) -> list[dict[str, Any]]:
    from geolimit.errors import GeolimitError
    from geolimit.server.config import load_config

    names = regions()
    secrets_dir = state / "secrets"
    write_secrets(secrets_dir)
    plan = []
    for name in names:
        out = state / "config" / name
        out.mkdir(parents=True, exist_ok=True)
        parsed: dict[str, dict[str, Any]] = {}
        for kind in ("agent", "proxy"):
            source = DEPLOY / "config" / name / f"{kind}.toml"
            text = render_text(source.read_text(encoding="utf-8"), names, offset, secrets_dir)
            target = out / f"{kind}.toml"
            target.write_text(text, encoding="utf-8")
            parsed[kind] = tomllib.loads(text)
        try:
            load_config(out / "agent.toml")
        except GeolimitError as exc:
            raise RenderError(f"rendered agent config does not load: {exc}") from None
        if with_proxy:
            try:
                load_proxy(out / "proxy.toml")
            except GeolimitError as exc:
                raise RenderError(f"rendered proxy config does not load: {exc}") from None
        plan.append(plan_region(name, parsed["agent"], parsed["proxy"]))
    prometheus = DEPLOY / "prometheus" / "prometheus.yml"
    (state / "prometheus.yml").write_text(
        render_text(prometheus.read_text(encoding="utf-8"), names, offset, secrets_dir), encoding="utf-8"
    )
    if check_ports:
        check_ports_free(plan, with_proxy)
    (state / "plan.json").write_text(json.dumps({"offset": offset, "regions": plan}, indent=2) + "\n")
    columns = ("region", "redis_port", "app_port")
    lines = ["\t".join(str(entry[c]) for c in columns) for entry in plan]
    (state / "plan.tsv").write_text("\n".join(lines) + "\n")
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, type=Path, help="directory to write into")
    parser.add_argument("--offset", type=int, default=0, help="added to every port (default: 0)")
    parser.add_argument("--no-proxy", action="store_true", help="do not validate the proxy configs")
    parser.add_argument("--no-port-check", action="store_true", help="do not check that the ports are free")
    args = parser.parse_args(argv)
    try:
        render(args.state.resolve(), args.offset, not args.no_proxy, not args.no_port_check)
    except (RenderError, OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"render: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`geolimit proxy --workers 2`: two proxy processes on one port under a supervisor, real Redis and upstream.

One /metrics scrape (on the shared admin port) counts every worker's requests;
SIGHUP reaches both workers; SIGTERM stops them all; bad `workers` values are
refused before anything starts, and so is a port another process holds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from tests.proxy.helpers import ProxyProcess, Upstream, dump_toml, proxy_config
from tests.server.helpers import cli
from tests.support.cli_fixtures import http, supervisors
from tests.support.cli_usage import run_cli
from tests.support.regions import eventually

__all__ = ["http", "supervisors"]  # fixtures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(upstream: Upstream, redis_url: str, **proxy: Any) -> dict[str, Any]:
    data = proxy_config([upstream.url], redis_url=redis_url, rules=[{"name": "api", "limit": "1000000/1h"}],
                        routes=[{"path": "/info", "limits": [{"rule": "api", "key": "header:X-User"}]}],
                        listen=f"127.0.0.1:{free_port()}", admin_listen=f"127.0.0.1:{free_port()}", **proxy)
    data["log"] = {"level": "INFO"}
    return data


def requests_in_snapshots(directory: str) -> dict[int, float]:
    """geolimit_proxy_responses_total per worker pid, from the live snapshots in the metrics directory."""
    found: dict[int, float] = {}
    for name in os.listdir(directory):
        if name.startswith("live-") and name.endswith(".json"):
            data = json.loads(Path(directory, name).read_text())
            found[int(name.split("-")[1])] = sum(
                s[2] for f in data["families"] if f["name"] == "geolimit_proxy_responses" for s in f["samples"]
                if s[0] == "geolimit_proxy_responses_total")
    return found


def total(text: str, sample: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{sample}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


async def test_two_proxy_workers_share_the_port_and_one_scrape_counts_both(
    tmp_path: Path, upstream: Upstream, redis_url: str, redis_client: redis.Redis,
    supervisors: list[ProxyProcess], http: aiohttp.ClientSession,
) -> None:
    data = config(upstream, redis_url)
    path = tmp_path / "proxy.toml"
    path.write_text(dump_toml(data))
    proc = await ProxyProcess.start(path, "--workers", "2")
    supervisors.append(proc)
    directory = (await proc.wait_for_log(r"proxy: started 2 workers \(pids (.*); shared metrics in (\S+)\)")).group(2)
    pids = [int(p) for p in re.findall(r"\d+", (await proc.wait_for_log(r"started 2 workers \(pids ([\d, ]+);")).group(1))]
    for index in (0, 1):
        await proc.wait_for_log(rf"\[worker {index}\]: proxy listening on .* as worker {index} of 2")
    url = "http://" + data["proxy"]["listen"]
    admin = "http://" + data["proxy"]["admin_listen"]

    sent = 0

    async def both_served() -> bool:
        nonlocal sent
        for _ in range(10):
            async with http.get(url + "/info", headers={"X-User": f"u{sent % 7}"}) as resp:
                assert resp.status == 200, await resp.text()
            sent += 1
        counts = requests_in_snapshots(directory)
        return all(counts.get(pid, 0) > 0 for pid in pids)

    await eventually(both_served, timeout=30, what="requests served by both proxy workers")

    answered: dict[int, tuple[float, float]] = {}

    async def scrape() -> bool:
        async with http.get(admin + "/metrics") as resp:
            text = await resp.text()
        worker = int(re.search(r'^target_info\{worker="(\d)",workers="2"\} 1\.0$', text, re.M).group(1))  # type: ignore[union-attr]
        answered[worker] = (total(text, "geolimit_proxy_responses_total"), total(text, "geolimit_proxy_decisions_total"))
        assert answered[worker][0] <= sent, answered
        return answered == {0: (sent, sent), 1: (sent, sent)}

    await eventually(scrape, timeout=20, pause=0.1, what=f"each worker's scrape counting {sent} requests",
                     explain=lambda: str(answered))

    mark = len(proc.lines)
    proc.proc.send_signal(signal.SIGHUP)
    for index in (0, 1):
        await proc.wait_for_log(rf"\[worker {index}\]: proxy: reloaded", after=mark)

    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait(timeout=30) == 0, proc.log
    assert "workers stopped (worker 0 exited with code 0, worker 1 exited with code 0)" in proc.log, proc.log
    assert os.path.basename(directory) not in os.listdir(os.path.dirname(directory))


@pytest.mark.parametrize(("proxy", "args", "expected"), [
    pytest.param({"workers": 0}, (), "proxy.workers must be an integer from 1 to 64, got 0", id="toml-zero"),
    pytest.param({"workers": 2, "listen": "127.0.0.1:0"}, (), "proxy.workers = 2 needs a fixed port in proxy.listen",
                 id="port-0"),
    pytest.param({}, ("--workers", "2"), "--workers = 2 needs a fixed port in proxy.listen", id="cli-port-0"),
])
async def test_bad_workers_values_are_config_errors(
    tmp_path: Path, upstream: Upstream, proxy: dict[str, Any], args: tuple[str, ...], expected: str,
) -> None:
    data = proxy_config([upstream.url], redis_url="redis://127.0.0.1:1/0", rules=[{"name": "api", "limit": "5/s"}],
                        **proxy)
    (tmp_path / "proxy.toml").write_text(dump_toml(data))
    ran = await cli("proxy", "--config", str(tmp_path / "proxy.toml"), *args)
    assert ran.code == 1, ran
    assert ran.stderr.startswith("geolimit: error: "), ran.stderr
    assert expected in ran.stderr, ran.stderr


@pytest.mark.parametrize("held", ["proxy.listen", "proxy.admin_listen"])
def test_a_port_held_by_another_process_fails_the_supervisor_at_once(
    tmp_path: Path, upstream: Upstream, redis_url: str, held: str,
) -> None:
    """Workers that could not bind crash-looped (5 crashes, the last 8 s apart: 18 s of error lines)
    before the supervisor gave up; now it binds the ports first: one line, exit 1, no worker started."""
    with socket.socket() as squatter:  # holds the port without SO_REUSEPORT: no worker could bind it
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = int(squatter.getsockname()[1])
        data = config(upstream, redis_url, workers=2)
        data["proxy"][held.partition(".")[2]] = f"127.0.0.1:{port}"
        (tmp_path / "proxy.toml").write_text(dump_toml(data))
        ran = run_cli("proxy", "--config", str(tmp_path / "proxy.toml"))
    assert (ran.returncode, ran.stdout) == (1, ""), ran
    assert ran.stderr == (f"geolimit: error: proxy: cannot listen on {held} 127.0.0.1:{port}: "
                          "[Errno 98] Address already in use\n"), ran.stderr

"""deploy/local/run.sh: the 3-region layout as real processes (CI's stand-in for docker compose).

Each test runs the script as a subprocess in its own session, with a deadline, on ports
offset by 10000 (clear of a developer's `run.sh up` on the plain ports and of the test
Redis servers' 20000-30000 range), and then checks that every process it started is gone
and every port is free again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.signals import default_sigint

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "deploy" / "local" / "run.sh"
OFFSET = 10000
REGIONS = ("us-east", "eu-west", "ap-south")

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Ran:
    code: int
    output: str
    seconds: float


def start(state: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``run.sh ARGS --offset 10000 --state STATE`` in its own session, output on one pipe."""
    runtime = state.parent / "runtime"  # where `up` notes its state dir for `down`: one per test
    runtime.mkdir(exist_ok=True)
    environment = {**os.environ, "PYTHON": sys.executable, "XDG_RUNTIME_DIR": str(runtime), **(env or {})}
    environment.pop("GEOLIMIT_LOCAL_PORT_OFFSET", None)
    return subprocess.Popen(
        ["bash", str(RUN), *args, "--offset", str(OFFSET), "--state", str(state)],
        cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=default_sigint,
    )


def run(state: Path, *args: str, timeout: float = 180.0, env: dict[str, str] | None = None) -> Ran:
    """Run run.sh to completion; killed (its whole session) at the deadline."""
    started = time.monotonic()
    proc = start(state, *args, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # run.sh's trap stops what it started
        output, _ = proc.communicate(timeout=60)
        kill_leftovers(state)
        pytest.fail(f"run.sh {' '.join(args)} did not finish within {timeout:.0f}s; output:\n{output}")
    return Ran(proc.returncode, output, time.monotonic() - started)


def recorded(state: Path) -> list[tuple[str, int, str]]:
    """(name, pid, start time) of every process run.sh recorded (``pids`` while running,
    ``pids.stopped`` after its teardown)."""
    out = []
    for name in ("pids", "pids.stopped"):
        path = state / name
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                out.append((parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""))
    return out


def alive(pid: int, since: str) -> bool:
    """Is ``pid`` still the process run.sh started (same start time as recorded, not a zombie)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] == "Z":
        return False
    started = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()
    return "_".join(started.split()) == "_".join(since.split("_"))


def kill_leftovers(state: Path) -> list[str]:
    left = [f"{name} (pid {pid})" for name, pid, since in recorded(state) if alive(pid, since)]
    for _, pid, since in recorded(state):
        if alive(pid, since):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return left


def ports(state: Path, with_proxy: bool = True) -> list[int]:
    plan = json.loads((state / "plan.json").read_text())["regions"]
    return [p for region in plan for p in (region["ports"] if with_proxy else region["ports"][:4])]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def assert_torn_down(state: Path, expected: int, with_proxy: bool = True) -> None:
    names = [name for name, _, _ in recorded(state)]
    assert len(names) == expected, names
    assert not (state / "pids").exists(), "run.sh did not finish its teardown"
    left = kill_leftovers(state)
    assert not left, f"processes left behind: {left}"
    busy = [p for p in ports(state, with_proxy) if not port_free(p)]
    assert not busy, f"ports still in use after teardown: {busy}"


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    yield path
    kill_leftovers(path)


def test_smoke_through_the_proxies_holds_the_global_limit_exactly(state: Path) -> None:
    ran = run(state, "smoke")
    assert ran.code == 0, ran.output
    assert "run.sh: smoke: PASS" in ran.output
    assert "FAIL" not in ran.output
    for line in ("us-east: 12 of 12 allowed", "eu-west: 12 of 12 allowed", "ap-south: 6 of 12 allowed",
                 "30 allowed world-wide, the limit is 30", "every region denies once the limit is used up",
                 "ap-south: the app served 6", "ap-south: geolimit_proxy_decisions_total counts 6 allowed and 7 denied",
                 "metrics of the Grafana dashboard are exposed"):
        assert line in ran.output, ran.output
    names = sorted(name for name, _, _ in recorded(state))
    assert names == sorted(f"{s}-{r}" for s in ("redis", "agent", "app", "proxy") for r in REGIONS)
    assert_torn_down(state, 12)
    for region in REGIONS:  # every agent flushed and stopped on SIGTERM
        log = (state / "logs" / f"agent-{region}.log").read_text()
        assert f"agent {region}: stopped" in log, log[-2000:]
    print(f"run.sh smoke: {ran.seconds:.1f}s")


def test_smoke_without_proxies_asks_the_agents(state: Path) -> None:
    ran = run(state, "smoke", "--no-proxy")
    assert ran.code == 0, ran.output
    assert "via the agents' /v1/check (--no-proxy)" in ran.output
    assert "ap-south: geolimit_decisions_total counts 6 allowed and 7 denied" in ran.output
    assert_torn_down(state, 9, with_proxy=False)


def test_up_detached_then_down(state: Path) -> None:
    up = run(state, "up", "--detach", "--no-proxy")
    assert up.code == 0, up.output
    assert "running detached" in up.output
    live = recorded(state)
    assert len(live) == 9, up.output
    assert all(alive(pid, since) for _, pid, since in live), up.output
    plan = json.loads((state / "plan.json").read_text())["regions"]
    assert not port_free(plan[0]["ports"][1]), "the agent listens"
    again = run(state, "up", "--no-proxy")
    assert again.code == 2, again.output
    assert "already running" in again.output
    down = run(state, "down")
    assert down.code == 0, down.output
    assert_torn_down(state, 9, with_proxy=False)


def test_up_in_the_foreground_stops_everything_on_ctrl_c(state: Path) -> None:
    proc = start(state, "up")
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    try:
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "run.sh up did not come up within 120 s:\n" + "".join(lines)
            time.sleep(0.05)
        assert len(recorded(state)) == 12
        assert all(alive(pid, since) for _, pid, since in recorded(state))
        proc.send_signal(signal.SIGINT)  # Ctrl-C reaches the shell; its children run in their own sessions
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        reader.join(timeout=10)
    assert any("curl -i -H 'X-Tenant: acme'" in line for line in lines), "".join(lines)
    assert_torn_down(state, 12)


def test_a_taken_port_stops_it_before_anything_starts(state: Path) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past connections' TIME_WAIT is no obstacle
        sock.bind(("127.0.0.1", 7412 + OFFSET))  # eu-west's agent API
        sock.listen()
        ran = run(state, "smoke")
    assert ran.code == 2, ran.output
    assert f"port 127.0.0.1:{7412 + OFFSET} (eu-west) is taken" in ran.output
    assert recorded(state) == []


def test_a_process_that_dies_while_starting_fails_the_run_and_the_rest_stops(state: Path, tmp_path: Path) -> None:
    broken = tmp_path / "redis-server"
    broken.write_text("#!/bin/sh\necho 'this redis-server cannot start' >&2\nexit 3\n")
    broken.chmod(0o755)
    ran = run(state, "smoke", env={"GEOLIMIT_REDIS_SERVER": str(broken)}, timeout=120)
    assert ran.code == 1, ran.output
    assert "exited while starting" in ran.output
    assert "this redis-server cannot start" in ran.output
    assert ran.seconds < 60, "the failure is reported at once, not at the deadline"
    assert_torn_down(state, 3, with_proxy=False)

"""deploy/local/run.sh removes the temp dir it made (secrets included) on every exit path."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "deploy" / "local" / "run.sh"
OFFSET = "10300"  # clear of test_local_smoke.py's 10000 and of a developer's plain ports

pytestmark = pytest.mark.timeout(240)


def _run_sh(tmp: Path, *args: str) -> subprocess.Popen[str]:
    (tmp / "runtime").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp), "XDG_RUNTIME_DIR": str(tmp / "runtime")}
    env.pop("GEOLIMIT_LOCAL_PORT_OFFSET", None)
    return subprocess.Popen(
        ["bash", str(RUN), *args, "--offset", OFFSET], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _state_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("geolimit-local.*"))


def test_temp_dir_and_secrets_are_removed_when_interrupted_during_start_up(tmp_path: Path) -> None:
    proc = _run_sh(tmp_path, "up", "--no-proxy")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the secrets exist and a process was started
            dirs = _state_dirs(tmp_path)
            if dirs and (dirs[0] / "secrets").is_dir() and (dirs[0] / "pids").is_file() \
                    and (dirs[0] / "pids").read_text().strip():
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        else:
            pytest.fail("run.sh did not start within 60 s")
        plan = json.loads((dirs[0] / "plan.json").read_text())["regions"]
        os.killpg(proc.pid, signal.SIGTERM)  # as a terminal's process-group signal would
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 143, output
    assert "stopping" in output, output
    assert _state_dirs(tmp_path) == [], f"temp dir left behind; output:\n{output}"
    assert "--keep" in output
    busy = [port for region in plan for port in region["ports"] if not _port_free(port)]
    assert not busy, f"processes still listen on {busy} after run.sh exited; output:\n{output}"


def test_up_detached_then_down_removes_the_temp_dir(tmp_path: Path) -> None:
    up = _run_sh(tmp_path, "up", "--detach", "--no-proxy")
    output, _ = up.communicate(timeout=180)
    assert up.returncode == 0, output
    [state] = _state_dirs(tmp_path)
    assert (state / "secrets").is_dir()
    down = _run_sh(tmp_path, "down")
    output, _ = down.communicate(timeout=120)
    assert down.returncode == 0, output
    assert _state_dirs(tmp_path) == [], output

"""The web examples on their embedded redis-server, stopped as a supervisor or Ctrl-C would:
the redis-server child and its /tmp/geolimit-redis-* dir must not outlive them.

uvicorn catches SIGTERM and SIGINT, shuts down gracefully, puts the previous handlers back
and raises the signal again; aiohttp turns them into a normal exit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.middleware.servers import free_port, wait_until_ready
from tests.support.embedded_children import (
    child_env,
    default_signals,
    processes_working_in,
    temp_dirs,
    wait_until,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("script", ["fastapi_app.py", "starlette_app.py", "aiohttp_app.py"])
def test_stopped_example_leaves_no_redis_behind(script: str, sig: signal.Signals, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "example.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--port", str(port)],  # no --redis-url: embedded
            stdout=out, stderr=subprocess.STDOUT, text=True, env=child_env(tmp_path), preexec_fn=default_signals,
        )
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/health", log.read_text)
        [redis_pid] = processes_working_in(tmp_path)
        assert len(temp_dirs(tmp_path)) == 1
        process.send_signal(sig)
        code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code in (0, -sig), log.read_text()  # uvicorn re-raises the signal; aiohttp exits 0
    wait_until(lambda: not processes_working_in(tmp_path), f"redis-server {redis_pid} is gone")
    assert temp_dirs(tmp_path) == [], log.read_text()

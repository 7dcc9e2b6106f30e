"""`geolimit redis` and `geolimit try --embedded`: a newcomer gets a Redis without installing one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from tests.support.signals import default_sigint


def _read_url(proc: subprocess.Popen[str], deadline: float) -> str:
    """The first stdout line (the server's URL), waiting at most until ``deadline``."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buffered = ""
    while time.monotonic() < deadline:
        chunk = proc.stdout.readline()
        buffered += chunk or ""
        if buffered.endswith("\n"):
            return buffered.strip()
        if proc.poll() is not None:
            raise AssertionError(f"`geolimit redis` exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.02)
    raise AssertionError(f"no URL printed within the deadline (got {buffered!r})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_geolimit_redis_prints_a_url_that_answers_and_stops_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "geolimit", "redis"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = _read_url(proc, time.monotonic() + 30)
        assert url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(url, socket_timeout=5)
        assert client.ping() is True
        server_pid = int(client.info("server")["process_id"])
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _pid_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(server_pid), "redis-server outlived `geolimit redis`"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_geolimit_redis_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "geolimit", "redis"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,
    )
    try:
        url = _read_url(proc, time.monotonic() + 30)
        assert redis.Redis.from_url(url, socket_timeout=5).ping() is True
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_try_embedded_needs_no_redis() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "geolimit", "try", "--embedded", "--times", "3", "2/10s", "user:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("embedded redis-server at redis://127.0.0.1:")
    assert [line.split()[0] for line in lines[1:]] == ["allowed", "allowed", "denied"]

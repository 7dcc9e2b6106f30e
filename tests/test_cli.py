"""The command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "geolimit.cli", *args], capture_output=True, text=True, timeout=60)


def test_version() -> None:
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("geolimit ")


def test_python_dash_m_geolimit_is_the_same_command() -> None:
    out = subprocess.run([sys.executable, "-m", "geolimit", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _run("--version").stdout


def test_try_against_a_real_redis(redis_url: str, redis_client: object) -> None:
    out = _run("try", "--redis", redis_url, "--times", "4", "3/10s", "user:42")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["allowed", "allowed", "allowed", "denied"]


def test_bad_rate_is_a_clear_error(redis_url: str) -> None:
    out = _run("try", "--redis", redis_url, "3 per fortnight", "u")
    assert out.returncode == 1
    assert "invalid rate '3 per fortnight'" in out.stderr

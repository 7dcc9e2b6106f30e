"""The arguments of `geolimit try` and `geolimit redis` are checked before any redis-server starts.

Once, `try --embedded abc user` (a bad RATE) exited 1 where other usage errors exit 2,
`try --embedded --region ''` started the embedded Redis before refusing the name,
`redis --host example.com` said "no free TCP port on example.com in range (20000, 30000)",
and `redis --host 0.0.0.0` bound every interface without a word. Every test runs the real CLI.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import redis

from tests.support.cli_usage import assert_usage_error, run_cli
from tests.test_cli_redis import _read_url


@pytest.mark.parametrize(("rate", "expected"), [
    ("abc", "invalid rate 'abc': expected '<count>/<window>' such as"),
    ("5/0s", "invalid rate '5/0s': the window '0s' must be greater than zero"),
    ("10/hour;", "invalid rate '10/hour;': limit 2 of 2 is empty"),
    ("5/m;6/minute", "invalid rate '5/m;6/minute': two limits over the same window (1m); keep the stricter one"),
])
def test_try_with_a_bad_rate_is_a_usage_error(rate: str, expected: str) -> None:
    line = assert_usage_error(run_cli("try", "--embedded", rate, "user:1"), "try", "rate")
    assert expected in line, line


def test_try_refuses_a_bad_region_before_starting_the_embedded_redis() -> None:
    line = assert_usage_error(run_cli("try", "--embedded", "--region", "", "5/10s", "user:1"), "try", "--region")
    assert "invalid region name '': use 1-64 characters" in line, line
    assert_usage_error(run_cli("try", "--embedded", "--region", "us east", "5/10s", "user:1"), "try", "--region")


@pytest.mark.parametrize(("host", "why"), [
    ("192.0.2.1", "not a local address"),  # TEST-NET-1: documentation only, never this machine's
    ("nowhere.invalid", "cannot resolve it"),  # .invalid never resolves
    ("", "got ''"),
])
def test_redis_on_a_host_that_is_not_local_is_a_usage_error(host: str, why: str) -> None:
    line = assert_usage_error(run_cli("redis", "--host", host), "redis", "--host")
    assert f"must be an address of this machine, such as 127.0.0.1 (loopback) or 0.0.0.0 (every interface), " \
           f"got {host!r}" in line, line
    assert why in line, line


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False), ("localhost", False)])
def test_redis_warns_on_stderr_when_the_host_is_not_loopback(host: str, warned: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "geolimit", "redis", "--host", host],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _read_url(proc, time.monotonic() + 30)
        port = int(url.rpartition(":")[2].partition("/")[0])
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)  # still allowed: it runs
        assert client.ping() is True
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        lines = proc.stderr.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    warning = (f"geolimit: warning: --host {host} is not a loopback address: this redis-server (no password) "
               "listens on every network interface, where other machines may reach it")
    assert (lines[0] == warning) is warned, lines
    assert not any("warning" in line for line in lines[1:]), lines

"""What a newcomer sees when a command cannot do what was asked: one line on stderr, no traceback.

Exit code 2 for a usage error (the flag is named, nothing is started), 1 for a runtime failure,
141 (as a shell reports SIGPIPE) when stdout's reader went away. Every test runs the real CLI.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.cli_usage import assert_usage_error, run_cli

# -- 1. `geolimit redis --port P` with P held by another process ----------------------------


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _http_server() -> Iterator[int]:
    """An HTTP server on a loopback port (it answers Redis' PING with an HTTP error page)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def _listening_socket() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.mark.parametrize("holder", [_http_server, _listening_socket], ids=["http-server", "bare-socket"])
def test_redis_on_a_port_in_use_says_so_and_how_to_pick_another(
    holder: Callable[[], contextlib.AbstractContextManager[int]],
) -> None:
    """Once, an HTTP server on the port ended in redis-py's InvalidResponse traceback."""
    with holder() as port:
        out = run_cli("redis", "--port", str(port))
    assert (out.returncode, out.stdout) == (1, ""), out
    assert out.stderr == (
        f"geolimit: error: port {port} on 127.0.0.1 is already in use by another process; "
        "pick another with --port N, or leave --port out to get a free one\n"
    )


# -- 2. stdout closed early (`geolimit status --json | head -c 10`) ---------------------------


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader is already gone: every write fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return run_cli(*args, stdout=write_end)
    finally:
        os.close(write_end)


@pytest.fixture
def agent_url(tmp_path: Path, redis_url: str) -> Iterator[str]:
    """A real ``geolimit agent`` (on the session's Redis, keys of its own), stopped afterwards."""
    (tmp_path / "gossip.key").write_text(secrets.token_hex(32) + "\n")
    (tmp_path / "region.toml").write_text(
        f'[region]\nname = "a"\nredis_url = "{redis_url}"\nlisten = "127.0.0.1:0"\n'
        f'key_prefix = "cli{secrets.token_hex(4)}"\nsecret_file = "gossip.key"\n\n'
        '[gossip]\ninterval = 0.1\npeers = []\n\n[[rule]]\nname = "api"\nlimit = "10/10s"\n'
    )
    log = tmp_path / "agent.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "geolimit", "agent", "--config", str(tmp_path / "region.toml")],
                                stdout=subprocess.DEVNULL, stderr=sink)
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on (http://[0-9.]+:\d+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the agent reported no URL (exit code {proc.poll()}); log:\n{log.read_text()}")
            time.sleep(0.05)
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_status_json_into_a_closed_pipe_exits_quietly(agent_url: str) -> None:
    """Once, `geolimit status --json | head -c 10` ended in a BrokenPipeError traceback."""
    assert run_cli("status", "--agent", agent_url, "--json").returncode == 0  # the agent answers
    out = _closed_pipe_run("status", "--agent", agent_url, "--json")
    assert (out.returncode, out.stderr) == (141, "")


def test_try_into_a_closed_pipe_exits_quietly(redis_url: str) -> None:
    out = _closed_pipe_run("try", "--redis", redis_url, "--times", "3", "3/10s", f"user:{secrets.token_hex(4)}")
    assert (out.returncode, out.stderr) == (141, "")


# -- 3. to 5. and the other numeric flags of try, redis, status and check: usage errors -----------


@pytest.mark.parametrize("value", ["0", "-1", "-0.5", "nan", "inf"])
@pytest.mark.parametrize("command", ["status", "check"])
def test_non_positive_timeout_is_a_usage_error_naming_the_flag(command: str, value: str) -> None:
    """Once, --timeout 0 gave a raw URLError and a negative one 'Timeout value out of range'."""
    args = ["api", "u"] if command == "check" else []
    line = assert_usage_error(run_cli(command, "--timeout", value, *args), command, "--timeout")
    assert f"must be a number of seconds greater than 0, such as 5 or 0.5, got {value!r}" in line


def test_try_embedded_with_redis_is_a_usage_error(redis_url: str) -> None:
    """Once, --redis was silently ignored next to --embedded."""
    for args in (["--embedded", "--redis", redis_url], ["--redis", redis_url, "--embedded"]):
        out = run_cli("try", *args, "2/10s", "u")
        assert out.returncode == 2, out
        assert "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
        assert re.search(r"argument --(redis|embedded): not allowed with argument --(embedded|redis)", out.stderr)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_try_times_below_one_is_a_usage_error(value: str) -> None:
    """Once, --times -1 was accepted: no hit, exit 0."""
    line = assert_usage_error(run_cli("try", "--embedded", "--times", value, "2/10s", "u"), "try", "--times")
    assert line.endswith(f"must be a whole number of at least 1, got {value!r} (see 'geolimit try --help')")


@pytest.mark.parametrize(("args", "flag"), [
    (["try", "--embedded", "--cost", "-1", "2/10s", "u"], "--cost"),
    (["try", "--embedded", "--cost", str(2**46 + 1), "2/10s", "u"], "--cost"),
    (["check", "--cost", "-1", "api", "u"], "--cost"),
    (["redis", "--port", "0"], "--port"),
    (["redis", "--port", "-5"], "--port"),
    (["redis", "--port", "65536"], "--port"),
], ids=["try-cost-negative", "try-cost-too-big", "check-cost-negative", "redis-port-0", "redis-port-negative",
        "redis-port-65536"])
def test_other_numeric_flags_out_of_range_are_usage_errors(args: list[str], flag: str) -> None:
    line = assert_usage_error(run_cli(*args), args[0], flag)
    assert f"got {args[args.index(flag) + 1]!r}" in line


def test_boundary_values_are_accepted(redis_url: str) -> None:
    out = run_cli("try", "--redis", redis_url, "--times", "1", "--cost", "0", "2/10s", f"user:{secrets.token_hex(4)}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("allowed  try  remaining=2 ")

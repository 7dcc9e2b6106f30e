"""An EmbeddedRedis ends with its Python process, also on SIGTERM: real processes, real signals.

Each script runs with TMPDIR in the test's tmp_path, so its ``geolimit-redis-*`` dir and
the redis-server working in it are found there (tests/support/embedded_children.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from geolimit.store.embedded import EmbeddedRedis
from tests.support.embedded_children import (
    child_env,
    default_signals,
    processes_working_in,
    temp_dirs,
    wait_until,
)

SERVE = textwrap.dedent(
    """
    import signal, sys, time
    from geolimit.store.embedded import EmbeddedRedis
    with EmbeddedRedis() as server:
        print("ready", server.pid, server.data_dir, flush=True)
        time.sleep(600)
    """
)


def _run(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``script``; its first stdout line, split, once it printed one."""
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
        env=child_env(tmp_path), preexec_fn=default_signals,
    )
    assert child.stdout is not None
    first = child.stdout.readline().split()  # blocks until the server is up (or the child died)
    assert first[:1] == ["ready"], f"child said {first!r}, exit code {child.poll()}"
    return child, first


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_stops_the_server_and_removes_its_temp_dir(sig: signal.Signals, tmp_path: Path) -> None:
    """Default dispositions: the process still dies of the signal, but without leaving anything."""
    child, (_, pid, data_dir) = _run(SERVE, tmp_path)
    assert processes_working_in(tmp_path) == [int(pid)]
    assert temp_dirs(tmp_path) == [Path(data_dir)]
    child.send_signal(sig)
    assert child.wait(timeout=30) == -sig  # the exit status it would have had without geolimit
    wait_until(lambda: not processes_working_in(tmp_path), f"redis-server {pid} is gone")
    assert temp_dirs(tmp_path) == []


def test_an_application_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    """A handler set before start() stays; the program then ends normally and cleans up.
    geolimit's own handler goes away with the last server; meanwhile the signal counts as
    unclaimed (tests/support/netns.py replaces it with its own)."""
    script = textwrap.dedent(
        """
        import signal, threading
        from geolimit.store.embedded import EmbeddedRedis, lifetime
        with EmbeddedRedis():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            assert lifetime.unclaimed(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        stop = threading.Event()
        def on_term(signum, frame):
            stop.set()
        signal.signal(signal.SIGTERM, on_term)
        assert not lifetime.unclaimed(signal.SIGTERM)
        with EmbeddedRedis() as server:
            assert signal.getsignal(signal.SIGTERM) is on_term
            assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
            print("ready", server.pid, flush=True)
            while not stop.wait(0.05):
                pass
        assert signal.getsignal(signal.SIGTERM) is on_term
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        print("application handler ran", flush=True)
        """
    )
    child, (_, pid) = _run(script, tmp_path)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 0
    assert child.stdout is not None
    assert child.stdout.read() == "application handler ran\n"
    assert not processes_working_in(tmp_path), f"redis-server {pid} survived"
    assert temp_dirs(tmp_path) == []


def test_a_forked_child_leaves_its_parents_server_alone(tmp_path: Path) -> None:
    """A fork inherits the handler and the list of servers: SIGTERM to it must not stop them."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from geolimit.store.embedded import EmbeddedRedis
        with EmbeddedRedis() as server:
            print("ready", flush=True)
            kid = os.fork()
            if kid == 0:
                time.sleep(600)
                os._exit(0)
            os.kill(kid, signal.SIGTERM)
            _, status = os.waitpid(kid, 0)
            with server.client() as client:
                print(os.WTERMSIG(status), client.ping(), server.data_dir.is_dir(), flush=True)
        """
    )
    child, _ = _run(script, tmp_path)
    assert child.wait(timeout=30) == 0
    assert child.stdout is not None
    assert child.stdout.read() == f"{int(signal.SIGTERM)} True True\n"
    assert temp_dirs(tmp_path) == []


def test_a_server_started_off_the_main_thread_leaves_signals_alone() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    seen: list[object] = []

    def run() -> None:
        with EmbeddedRedis() as server:
            seen.append(server.client().ping())
            seen.extend(signal.getsignal(sig) for sig in before)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert seen == [True, *before.values()]

"""A process using EmbeddedRedis, signalled by a test: where its redis-server and temp dir are.

The process runs with ``TMPDIR`` pointing at a directory of the test's own, so its
``geolimit-redis-*`` temp dirs, and the redis-server children working in them, are found
there and only there (other test runs leave theirs in /tmp).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def default_signals() -> None:
    """``preexec_fn``: SIGINT, SIGTERM and SIGHUP at their default disposition in the child,
    however the test run was started (a background job ignores SIGINT, nohup SIGHUP)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def child_env(tmpdir: Path) -> dict[str, str]:
    """The test's environment, with temp files (EmbeddedRedis's data dirs) under ``tmpdir``."""
    return {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}


def temp_dirs(tmpdir: Path) -> list[Path]:
    return sorted(tmpdir.glob("geolimit-redis-*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in {"Z", "X"}
    except OSError:
        return False


def processes_working_in(tmpdir: Path) -> list[int]:
    """Live processes whose working directory is under ``tmpdir`` (EmbeddedRedis starts
    redis-server in its data dir; redis rewrites its command line, so that is no help)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, or not ours
            continue
        if (cwd == str(tmpdir) or cwd.startswith(f"{tmpdir}/")) and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.02)

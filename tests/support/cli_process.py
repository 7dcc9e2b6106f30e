"""A long-running ``python -m geolimit.cli COMMAND --config ...`` process for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

import aiohttp

P = TypeVar("P", bound="CliProcess")


@dataclass
class CliProcess:
    """The process, with its stderr collected line by line."""

    command: ClassVar[str]  # the CLI sub-command, set by subclasses
    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls: type[P], config: Path, *extra: str) -> P:
        # The test's own temp dir: a supervisor sweeps the metrics directories that killed
        # supervisors left in its temp dir, and one started by a test running beside this one
        # (xdist) removed the directory this one's supervisor had just left (and asserted).
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "geolimit.cli", cls.command, "--config", str(config), *extra,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(config.parent)},
        )
        self = cls(proc)
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    async def wait_for_log(self, pattern: str, timeout: float = 20.0, after: int = 0) -> re.Match[str]:
        """The first log line (from line ``after`` on) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                found = re.search(pattern, line)
                if found:
                    return found
            if self.proc.returncode is not None and self._reader is not None and self._reader.done():
                break
            await asyncio.sleep(0.02)
        raise AssertionError(f"no log line matching {pattern!r} (exit code {self.proc.returncode}); log:\n{self.log}")

    async def wait(self, timeout: float = 20.0) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise AssertionError(f"the {self.command} did not exit within {timeout}s; log:\n{self.log}") from None
        if self._reader is not None:
            await asyncio.wait_for(self._reader, timeout)
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


async def stop_all(procs: list[P], timeout: float = 20.0) -> None:
    """Teardown: SIGTERM each process still running and give it ``timeout`` seconds to stop
    (supervisors stop their workers), then kill whatever is left."""
    for proc in procs:
        if proc.proc.returncode is None:
            proc.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                await proc.wait(timeout=timeout)
        await proc.kill()


def any_worker_session() -> aiohttp.ClientSession:
    """A client that opens a new connection per request, so requests land on any worker
    sharing a port."""
    connector = aiohttp.TCPConnector(force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10))

"""Several worker processes on one port: the supervisor of ``geolimit agent --workers N`` and ``geolimit proxy --workers N``.

The :class:`Supervisor` starts N worker processes (``python -m geolimit PROGRAM
--config PATH --workers N --worker-index I [ARGS]``), which share their
listening ports with ``SO_REUSEPORT``. It forwards SIGTERM/SIGINT (graceful
stop) and SIGHUP (reload) to every worker, restarts a worker that exits on its
own after an exponential backoff (logged as an error), and gives up, stopping
the others and exiting 1, when one worker crashes ``max_crashes`` times within
``crash_window`` seconds. A worker stops (as on SIGTERM) when its supervisor
disappears (:func:`watch_parent`). Before it starts any worker it binds each of
its ``listens`` addresses once: a port another process holds is one error and
exit 1 at once, not a crash loop of workers that cannot bind it.

It also creates a private directory for the workers' metrics
(geolimit/worker_metrics.py), names it to them in ``GEOLIMIT_WORKER_METRICS_DIR``,
marks a worker's snapshot dead when the worker exits and removes the directory
when it stops, so that one ``/metrics`` scrape of any worker describes them all.
The directory's name carries the supervisor's pid: a supervisor that was killed
(SIGKILL, the OOM killer) could not remove its own, so the next one to start
removes those of supervisors no longer running (:func:`sweep_stale_metrics_dirs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from geolimit.errors import ConfigError, GeolimitError
from geolimit.worker_metrics import METRICS_DIR_ENV, mark_dead

__all__ = ["Supervisor", "describe_exit", "sweep_stale_metrics_dirs", "watch_parent"]

log = logging.getLogger("geolimit.workers")


async def watch_parent(stop: asyncio.Event, interval: float = 0.5) -> None:
    """Set ``stop`` when this process's parent (the supervisor) is gone."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(interval)
        if os.getppid() != parent:
            break
    log.error("the supervisor (pid %d) is gone: this worker stops", parent)
    stop.set()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_metrics_dirs(program: str, base: str | None = None) -> list[str]:
    """Remove the metrics directories that supervisors of ``program`` left behind when
    they were killed: ``geolimit-PROGRAM-metrics-PID-*`` in ``base`` (the temp dir),
    owned by this user, whose PID no longer runs. Returns the paths removed. A pid
    taken by another process since keeps its directory (until that one ends)."""
    base = base or tempfile.gettempdir()
    prefix = f"geolimit-{program}-metrics-"
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        pid_text, dash, _ = name[len(prefix):].partition("-")
        if not name.startswith(prefix) or not dash or not pid_text.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _running(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def describe_exit(code: int) -> str:
    """'exited with code 1', 'was killed by SIGKILL'."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(eq=False)
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    crashes: deque[float] = field(default_factory=deque)  # monotonic times of its recent exits
    restarts: int = 0
    keeper: asyncio.Task[None] | None = None


class Supervisor:
    """Starts ``workers`` processes of ``geolimit PROGRAM`` for ``config_path`` and keeps them running.

    ``start()`` starts them; ``wait()`` returns 1 once it gave up on a worker that
    keeps crashing; ``reload()`` sends SIGHUP to each; ``stop()`` sends SIGTERM,
    waits up to ``stop_timeout`` seconds (then SIGKILL) and returns 0 if every
    worker stopped cleanly, else 1. ``async with Supervisor(...)`` starts and stops.
    ``name`` starts its log messages ("agent us-east", "proxy"); ``args`` follow
    the worker's ``--worker-index``; ``command`` is how to run ``geolimit``.
    ``listens`` are the ``(setting, (host, port))`` addresses the workers share (an
    address of None, a setting left out, is skipped): ``start()`` raises
    :class:`GeolimitError` naming the first one it cannot bind.
    """

    def __init__(
        self,
        program: str,
        config_path: str | os.PathLike[str],
        workers: int,
        *,
        name: str | None = None,
        args: Sequence[str] = (),
        stop_timeout: float = 20.0,
        max_crashes: int = 5,
        crash_window: float = 60.0,
        first_backoff: float = 0.5,
        max_backoff: float = 10.0,
        command: Sequence[str] | None = None,
        listens: Sequence[tuple[str, tuple[str, int] | None]] = (),
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a positive integer, got {workers!r}")
        self.program = program
        self.config_path = os.path.abspath(config_path)
        self.workers = workers
        self.name = name or program
        self.args = list(args)
        self.stop_timeout = stop_timeout
        self.max_crashes = max_crashes
        self.crash_window = crash_window
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.command = list(command) if command is not None else [sys.executable, "-m", "geolimit"]
        self.listens = [(key, address) for key, address in listens if address is not None]
        self._workers: list[_Worker] = []
        self._stopping = asyncio.Event()
        self._gave_up = asyncio.Event()
        self.failure: str | None = None  # why it gave up
        self.metrics_dir: str | None = None  # the workers' shared metrics, while running

    # -- lifecycle ------------------------------------------------------------

    def check_listens(self) -> None:
        """Bind each of ``listens`` once and let it go (GeolimitError naming the one that fails):
        a worker that cannot bind its port would only crash, be restarted and crash again."""
        from geolimit.http.listener import check_listens  # aiohttp: only the servers need it

        check_listens(self.name, self.listens)

    async def start(self) -> None:
        """Start every worker (raises GeolimitError if a ``listens`` address cannot be bound,
        OSError if a worker cannot be spawned)."""
        if self._workers:
            return
        self.check_listens()
        for path in sweep_stale_metrics_dirs(self.program):
            log.info("%s: removed %s, left by a supervisor that was killed", self.name, path)
        self.metrics_dir = tempfile.mkdtemp(prefix=f"geolimit-{self.program}-metrics-{os.getpid()}-")
        for index in range(self.workers):
            worker = _Worker(index, await self._spawn(index))
            worker.keeper = asyncio.ensure_future(self._keep(worker))  # so stop() also ends a partial start
            self._workers.append(worker)
        log.info("%s: started %d workers (pids %s; shared metrics in %s)", self.name, self.workers,
                 ", ".join(str(w.proc.pid) for w in self._workers), self.metrics_dir)

    async def wait(self) -> int:
        """Until the supervisor gives up on a crashing worker; returns 1."""
        await self._gave_up.wait()
        return 1

    async def serve(self, stop: asyncio.Event) -> int:
        """Start the workers and keep them until ``stop`` is set or the supervisor gives up
        on a crashing worker; then stop them all. The process's exit code."""
        try:
            await self.start()
        except GeolimitError as exc:  # a port held by another process: no worker was started
            print(f"geolimit: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except OSError as exc:
            log.error("%s: cannot start its workers: %s", self.name, exc)
            await self.stop()
            return 1
        gave_up = asyncio.ensure_future(self.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({gave_up, stopper}, return_when=asyncio.FIRST_COMPLETED)
        failed = gave_up.done()
        for task in (gave_up, stopper):
            task.cancel()
        await asyncio.gather(gave_up, stopper, return_exceptions=True)
        if not failed:
            log.info("%s: stopping %d workers", self.name, self.workers)
        code = await self.stop()
        return 1 if failed else code

    def reload(self) -> None:
        """Forward SIGHUP: every worker re-reads the config (and keeps it if invalid)."""
        for worker in self._workers:
            self._signal(worker, signal.SIGHUP)

    async def stop(self) -> int:
        """SIGTERM every worker (each stops gracefully), SIGKILL those still running after ``stop_timeout``."""
        self._stopping.set()
        for worker in self._workers:
            self._signal(worker, signal.SIGTERM)
        keepers = [w.keeper for w in self._workers if w.keeper is not None]
        if keepers:
            _, late = await asyncio.wait(keepers, timeout=self.stop_timeout)
            if late:
                for worker in self._workers:
                    if worker.proc.returncode is None:
                        log.error("%s: worker %d (pid %d) did not stop within %.0fs; killing it",
                                  self.name, worker.index, worker.proc.pid, self.stop_timeout)
                        self._signal(worker, signal.SIGKILL)
                await asyncio.gather(*late, return_exceptions=True)
        codes = [w.proc.returncode for w in self._workers]
        clean = all(code == 0 for code in codes)
        log.log(logging.INFO if clean else logging.ERROR, "%s: workers stopped (%s)", self.name,
                ", ".join(f"worker {w.index} {describe_exit(c if c is not None else -9)}"
                          for w, c in zip(self._workers, codes, strict=True)))
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None
        return 0 if clean else 1

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- introspection --------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """The current worker processes' ids, by index."""
        return [w.proc.pid for w in self._workers]

    @property
    def restarts(self) -> list[int]:
        """How often each worker was restarted."""
        return [w.restarts for w in self._workers]

    # -- internals ------------------------------------------------------------

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        if self.metrics_dir is not None:
            env[METRICS_DIR_ENV] = self.metrics_dir
        return await asyncio.create_subprocess_exec(
            *self.command, self.program, "--config", self.config_path, "--workers", str(self.workers),
            "--worker-index", str(index), *self.args,
            stdin=asyncio.subprocess.DEVNULL,  # stdout and stderr are the supervisor's: one log
            env=env,
        )

    @staticmethod
    def _signal(worker: _Worker, sig: signal.Signals) -> None:
        if worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(sig)

    async def _keep(self, worker: _Worker) -> None:
        """Restart ``worker`` whenever it exits on its own, until stop() or too many crashes."""
        while True:
            code = await worker.proc.wait()
            if self.metrics_dir is not None:  # its gauges stop counting; its counters stay in the totals
                mark_dead(self.metrics_dir, worker.proc.pid)
            if self._stopping.is_set():
                return
            now = time.monotonic()
            worker.crashes.append(now)
            while worker.crashes[0] < now - self.crash_window:
                worker.crashes.popleft()
            crashes = len(worker.crashes)
            if crashes >= self.max_crashes:
                self.failure = (f"worker {worker.index} {describe_exit(code)}; it crashed {crashes} times "
                                f"within {self.crash_window:g}s")
                log.critical("%s: %s: giving up, stopping every worker", self.name, self.failure)
                self._gave_up.set()
                return
            delay = min(self.max_backoff, self.first_backoff * 2 ** (crashes - 1))
            log.error("%s: worker %d (pid %d) %s unexpectedly; restarting it in %.1fs "
                      "(crash %d within %gs; the %s gives up at %d)", self.name, worker.index,
                      worker.proc.pid, describe_exit(code), delay, crashes, self.crash_window, self.program,
                      self.max_crashes)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            try:
                worker.proc = await self._spawn(worker.index)
            except OSError as exc:
                self.failure = f"cannot restart worker {worker.index}: {exc}"
                log.critical("%s: %s: giving up", self.name, self.failure)
                self._gave_up.set()
                return
            worker.restarts += 1
            log.warning("%s: worker %d restarted (pid %d)", self.name, worker.index, worker.proc.pid)
            if self._stopping.is_set():  # stop() ran while it was starting
                self._signal(worker, signal.SIGTERM)

"""Several agent worker processes per region (``geolimit agent --workers N``).

One Python process caps a region at about one core. With ``workers = N`` the
``geolimit agent`` process becomes a :class:`Supervisor` that starts N worker
processes (``python -m geolimit agent --config PATH --workers N --worker-index
I``); each is an ordinary :class:`~geolimit.server.agent.Agent` that:

* owns the virtual shards ``{s : s % N == I}`` (:func:`owned_shards`): it
  drains, packs, sends and recovers only their outboxes, while it merges cells
  of any shard that peers send it;
* binds the same listen addresses as the others with ``SO_REUSEPORT``, so the
  kernel spreads API and gossip connections over the workers;
* initiates anti-entropy only if it is worker 0 (every worker serves the
  exchanges peers start; an exchange's steps follow one pinned connection);
* signs with sequence numbers of its own residue class modulo N
  (:class:`WorkerSigner`), so two workers never send the same (region, seq)
  pair, which the peers' replay guard would refuse;
* stops (flushing, as on SIGTERM) when its supervisor disappears
  (:func:`watch_parent`).

The supervisor forwards SIGTERM/SIGINT (graceful stop) and SIGHUP (reload) to
every worker, restarts a worker that exits on its own after an exponential
backoff (logged as an error), and gives up, stopping the others and exiting
1, when one worker crashes ``max_crashes`` times within ``crash_window``
seconds. Nothing is lost when a worker dies: outboxes and in-flight batches
live in Redis, and the restarted worker returns its shards' in-flight batches
to their outboxes before it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from geolimit.replication.auth import Signer
from geolimit.server.config import MAX_WORKERS

__all__ = ["MAX_WORKERS", "Supervisor", "WorkerSigner", "describe_exit", "owned_shards", "watch_parent"]

log = logging.getLogger("geolimit.workers")


def owned_shards(shards: int, index: int, workers: int) -> list[int]:
    """The shards worker ``index`` of ``workers`` drains and sends: ``s % workers == index``."""
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} is not in [0, {workers})")
    return list(range(index, shards, workers))


class WorkerSigner(Signer):
    """A :class:`Signer` whose sequence numbers are ``index`` modulo ``workers``.

    Every worker of a region signs as that region, and a peer's replay guard
    refuses a (region, seq) pair it has seen. Sequence numbers are microsecond
    times, so two workers could pick the same one; taking disjoint residue
    classes makes that impossible, and they still increase across restarts.
    """

    def __init__(self, secret: bytes, region: str, clock: Callable[[], float] = time.time, *,
                 index: int, workers: int) -> None:
        super().__init__(secret, region, clock)
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} is not in [0, {workers})")
        self.index, self.workers = index, workers
        self._now = clock
        self._last = 0

    def next_seq(self) -> int:
        seq = max(self._last + 1, int(self._now() * 1_000_000))
        seq += (self.index - seq) % self.workers
        self._last = seq
        return seq


async def watch_parent(stop: asyncio.Event, interval: float = 0.5) -> None:
    """Set ``stop`` when this process's parent (the supervisor) is gone."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(interval)
        if os.getppid() != parent:
            break
    log.error("the supervisor (pid %d) is gone: this worker stops", parent)
    stop.set()


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
    """Starts ``workers`` agent processes for ``config_path`` and keeps them running.

    ``start()`` starts them; ``wait()`` returns 1 once it gave up on a worker that
    keeps crashing; ``reload()`` sends SIGHUP to each; ``stop()`` sends SIGTERM,
    waits up to ``stop_timeout`` seconds (then SIGKILL) and returns 0 if every
    worker stopped cleanly, else 1. ``async with Supervisor(...)`` starts and stops.
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        workers: int,
        *,
        region: str = "?",
        flush_timeout: float = 2.0,
        stop_timeout: float = 20.0,
        max_crashes: int = 5,
        crash_window: float = 60.0,
        first_backoff: float = 0.5,
        max_backoff: float = 10.0,  # below the 15 s change lease: a short outage loses no change marks
        command: Sequence[str] | None = None,
    ) -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be from 1 to {MAX_WORKERS}, got {workers!r}")
        self.config_path = os.path.abspath(config_path)
        self.workers = workers
        self.region = region
        self.flush_timeout = flush_timeout
        self.stop_timeout = stop_timeout
        self.max_crashes = max_crashes
        self.crash_window = crash_window
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.command = list(command) if command is not None else [sys.executable, "-m", "geolimit"]
        self._workers: list[_Worker] = []
        self._stopping = asyncio.Event()
        self._gave_up = asyncio.Event()
        self.failure: str | None = None  # why it gave up

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker (raises OSError if one cannot be spawned)."""
        if self._workers:
            return
        for index in range(self.workers):
            worker = _Worker(index, await self._spawn(index))
            worker.keeper = asyncio.ensure_future(self._keep(worker))  # so stop() also ends a partial start
            self._workers.append(worker)
        log.info("agent %s: started %d workers (pids %s)", self.region, self.workers,
                 ", ".join(str(w.proc.pid) for w in self._workers))

    async def wait(self) -> int:
        """Until the supervisor gives up on a crashing worker; returns 1."""
        await self._gave_up.wait()
        return 1

    def reload(self) -> None:
        """Forward SIGHUP: every worker re-reads the config (and keeps it if invalid)."""
        for worker in self._workers:
            self._signal(worker, signal.SIGHUP)

    async def stop(self) -> int:
        """SIGTERM every worker (each flushes its outboxes), SIGKILL those still running after ``stop_timeout``."""
        self._stopping.set()
        for worker in self._workers:
            self._signal(worker, signal.SIGTERM)
        keepers = [w.keeper for w in self._workers if w.keeper is not None]
        if keepers:
            _, late = await asyncio.wait(keepers, timeout=self.stop_timeout)
            if late:
                for worker in self._workers:
                    if worker.proc.returncode is None:
                        log.error("agent %s: worker %d (pid %d) did not stop within %.0fs; killing it",
                                  self.region, worker.index, worker.proc.pid, self.stop_timeout)
                        self._signal(worker, signal.SIGKILL)
                await asyncio.gather(*late, return_exceptions=True)
        codes = [w.proc.returncode for w in self._workers]
        clean = all(code == 0 for code in codes)
        log.log(logging.INFO if clean else logging.ERROR, "agent %s: workers stopped (%s)", self.region,
                ", ".join(f"worker {w.index} {describe_exit(c if c is not None else -9)}"
                          for w, c in zip(self._workers, codes, strict=True)))
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
        return await asyncio.create_subprocess_exec(
            *self.command, "agent", "--config", self.config_path, "--workers", str(self.workers),
            "--worker-index", str(index), "--flush-timeout", repr(self.flush_timeout),
            stdin=asyncio.subprocess.DEVNULL,  # stdout and stderr are the supervisor's: one log
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
                log.critical("agent %s: %s: giving up, stopping every worker", self.region, self.failure)
                self._gave_up.set()
                return
            delay = min(self.max_backoff, self.first_backoff * 2 ** (crashes - 1))
            log.error("agent %s: worker %d (pid %d) %s unexpectedly; restarting it in %.1fs "
                      "(crash %d within %gs; the agent gives up at %d)", self.region, worker.index,
                      worker.proc.pid, describe_exit(code), delay, crashes, self.crash_window, self.max_crashes)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            try:
                worker.proc = await self._spawn(worker.index)
            except OSError as exc:
                self.failure = f"cannot restart worker {worker.index}: {exc}"
                log.critical("agent %s: %s: giving up", self.region, self.failure)
                self._gave_up.set()
                return
            worker.restarts += 1
            log.warning("agent %s: worker %d restarted (pid %d)", self.region, worker.index, worker.proc.pid)
            if self._stopping.is_set():  # stop() ran while it was starting
                self._signal(worker, signal.SIGTERM)

"""Running an agent as a process: signals, workers, exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import sys
import time

from geolimit.core.clock import Clock
from geolimit.errors import ConfigError, GeolimitError
from geolimit.http.listener import run_event_loop
from geolimit.process import configure_logging, process_signals
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, load_config, with_workers
from geolimit.server.workers import Supervisor, watch_parent

__all__ = ["run_agent"]

log = logging.getLogger("geolimit.agent")

#: Seconds a graceful stop may take beyond the flush deadline before the agent aborts.
STOP_GRACE = 10.0
#: Test-only: seconds added to this agent's clock (its decisions, gossip and auth), to measure
#: clock skew between agents on one host (bench/agents.py). Unset, decisions use Redis TIME.
CLOCK_OFFSET_ENV = "GEOLIMIT_TEST_CLOCK_OFFSET"


def _test_clock() -> Clock | None:
    """The host clock shifted by ``$GEOLIMIT_TEST_CLOCK_OFFSET`` seconds, or None when it is unset."""
    raw = os.environ.get(CLOCK_OFFSET_ENV, "").strip()
    if not raw:
        return None
    try:
        offset = float(raw)
    except ValueError:
        offset = math.nan
    if not math.isfinite(offset):
        raise ConfigError(f"{CLOCK_OFFSET_ENV} must be a number of seconds, got {raw!r}")
    log.warning("agent clock is %+.3f s off the host clock (%s: for tests only)", offset, CLOCK_OFFSET_ENV)
    return lambda: time.time() + offset


async def _reload(agent: Agent, path: str) -> None:
    """SIGHUP: re-read the file; a file that does not validate keeps the old rules."""
    try:
        config = load_config(path)
        changed = await agent.reload(config)
    except GeolimitError as exc:
        log.error("agent %s: reload of %s refused, keeping the running configuration: %s",
                  agent.config.region, path, exc)
        return
    log.info("agent %s: reloaded %s (%s)", agent.config.region, path, changed or "no rule changes")


async def _serve(config: AgentConfig, flush_timeout: float, path: str | None = None,
                 worker_index: int | None = None, clock: Clock | None = None) -> int:
    agent = Agent(config, clock=clock, worker_index=worker_index or 0)
    with process_signals(None if path is None else lambda: _reload(agent, path)) as stop:
        # A worker whose supervisor is gone stops as on SIGTERM (it would hold the shared port).
        orphan = asyncio.ensure_future(watch_parent(stop)) if worker_index is not None else None
        try:
            return await _supervise(agent, config, stop, flush_timeout)
        finally:
            if orphan is not None:
                orphan.cancel()


async def _serve_workers(config: AgentConfig, flush_timeout: float, path: str, pinned: bool) -> int:
    """The supervisor of ``config.workers`` worker processes (``pinned``: --workers was given)."""
    listens = [(key, address) for key, address in (("region.listen", config.listen),
               ("region.api_listen", config.api_listen), ("region.rls_listen", config.rls_listen)) if address]
    supervisor = Supervisor(path, config.workers, region=config.region, flush_timeout=flush_timeout,
                            stop_timeout=flush_timeout + STOP_GRACE + 5.0, listens=listens)

    async def hangup() -> None:
        supervisor.reload()  # each worker re-reads the file and keeps its rules if it is invalid
        with contextlib.suppress(GeolimitError):
            workers = load_config(path).workers
            if not pinned and workers != config.workers:
                log.warning("agent %s: region.workers changed from %d to %d: restart the agent to apply it",
                            config.region, config.workers, workers)

    with process_signals(hangup) as stop:
        return await supervisor.serve(stop)


async def _supervise(agent: Agent, config: AgentConfig, stop: asyncio.Event, flush_timeout: float) -> int:
    try:
        await agent.start()
    except (GeolimitError, OSError, ssl.SSLError) as exc:
        what = str(exc) if isinstance(exc, GeolimitError) else f"agent {config.region} failed to start: {exc}"
        print(f"geolimit: error: {what}", file=sys.stderr, flush=True)
        await agent.abort()
        return 1
    waiter = asyncio.ensure_future(agent.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
        stopper.cancel()
        log.error("agent %s: stopping after a crash: %s", config.region, waiter.exception())
        await agent.abort()
        return 1
    waiter.cancel()
    stopper.cancel()
    await asyncio.gather(waiter, stopper, return_exceptions=True)
    log.info("agent %s: stopping (flushing outboxes for up to %.1fs)", config.region, flush_timeout)
    try:
        # The flush has its own deadline; the rest (closing connections, waiting for
        # in-flight API requests) gets a bounded grace period, so SIGTERM always ends.
        flushed = await asyncio.wait_for(agent.stop(flush_timeout), flush_timeout + STOP_GRACE)
    except Exception as exc:
        reason = f"not done within {flush_timeout + STOP_GRACE:.1f}s" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
        log.error("agent %s: graceful stop failed (%s); aborting", config.region, reason)
        await agent.abort()
        return 1
    log.info("agent %s: stopped%s", config.region,
             "" if flushed else " (changes not delivered yet wait in Redis, in the outboxes, for the next agent)")
    return 0


def run_agent(config_path: str, flush_timeout: float = 2.0, workers: int | None = None,
              worker_index: int | None = None) -> int:
    """Run the agent of ``config_path`` until SIGTERM/SIGINT; the process exit code.

    A bad config raises :class:`~geolimit.errors.ConfigError` (the CLI prints it and
    exits 1). On SIGTERM the agent stops accepting, tries once to deliver its
    outboxes within ``flush_timeout`` seconds, and returns 0. ``workers``
    overrides ``[region] workers``; with more than one, this process supervises
    that many worker processes (geolimit/server/workers.py), each run with its
    ``worker_index``.
    """
    if not flush_timeout >= 0:
        raise ConfigError(f"the flush timeout must be >= 0 seconds, got {flush_timeout!r}")
    config = load_config(config_path)
    if workers is not None:
        config = with_workers(config, workers)
    if worker_index is not None and not 0 <= worker_index < config.workers:
        raise ConfigError(f"--worker-index must be from 0 to {config.workers - 1}, got {worker_index}")
    configure_logging(config.log_format, config.log_level, worker_index if config.workers > 1 else None)
    if worker_index is None and config.workers > 1:
        return asyncio.run(_serve_workers(config, flush_timeout, config_path, workers is not None))
    return run_event_loop(_serve(config, flush_timeout, config_path, worker_index, _test_clock()))  # uvloop when installed

"""Running the proxy as a process: ``geolimit proxy --config proxy.toml [--workers N]``.

SIGTERM / SIGINT: stop accepting, let in-flight requests finish for up to
``shutdown_timeout`` seconds (then cancel them), exit 0. SIGHUP: re-read the
file; a file that does not validate is logged and the running configuration
stays. Exit 1 when the proxy cannot start (bad config; a port in use, named with its
setting and address: ``cannot listen on proxy.listen 127.0.0.1:8080: ...``).

With ``workers`` > 1 (``[proxy] workers`` or ``--workers``) this process is a
supervisor (geolimit/supervisor.py) of that many proxy processes sharing the
listeners with ``SO_REUSEPORT``: it binds ``listen`` and ``admin_listen`` once before
starting any worker (a port another process holds is one error and exit 1, not a
crash loop of workers that cannot bind it), forwards the signals above to each,
restarts a worker that dies, and gives up (exit 1) on one that keeps crashing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import replace

from geolimit.errors import ConfigError, GeolimitError
from geolimit.http.listener import run_event_loop
from geolimit.process import configure_logging, process_signals
from geolimit.proxy.config import ProxyConfig, load_proxy_config, with_workers
from geolimit.proxy.server import Proxy
from geolimit.supervisor import Supervisor, watch_parent

__all__ = ["run_proxy"]

log = logging.getLogger("geolimit.proxy")

#: Seconds a stop may take beyond shutdown_timeout (closing pools and connections).
STOP_GRACE = 5.0


async def _reload(proxy: Proxy, path: str) -> None:
    try:
        config = replace(load_proxy_config(path), workers=proxy.config.workers)  # workers: read at start only
        summary = await proxy.reload(config)
    except GeolimitError as exc:
        proxy.metrics.reload("refused")
        log.error("proxy: reload of %s refused, keeping the running configuration: %s", path, exc)
        return
    proxy.metrics.reload("ok")
    log.info("proxy: reloaded %s (%s)", path, summary)


def _check_listens(config: ProxyConfig) -> None:
    """Bind ``listen`` and ``admin_listen`` once and let them go: a GeolimitError naming the setting and the
    address that cannot be bound (a port another process holds), as the supervisor of several workers does."""
    from geolimit.http.listener import check_listens

    check_listens("proxy", [(key, address) for key, address in config.listens if address is not None])


async def _serve(config: ProxyConfig, path: str, worker_index: int | None = None) -> int:
    proxy = Proxy(config, worker_index=worker_index or 0)
    with process_signals(lambda: _reload(proxy, path)) as stop:
        # A worker whose supervisor is gone stops as on SIGTERM (it would hold the shared port).
        orphan = asyncio.ensure_future(watch_parent(stop)) if worker_index is not None else None
        try:
            try:
                if worker_index is None:  # a worker's supervisor checked them
                    _check_listens(config)
                await proxy.start()
            except (GeolimitError, OSError) as exc:
                print(f"geolimit: error: proxy failed to start: {exc}", file=sys.stderr, flush=True)
                return 1
            await stop.wait()
            log.info("proxy: stopping (in-flight requests may take up to %.1fs)", proxy.config.shutdown_timeout)
            try:
                await asyncio.wait_for(proxy.stop(), proxy.config.shutdown_timeout + STOP_GRACE)
            except Exception as exc:
                log.error("proxy: graceful stop failed (%r)", exc)
                return 1
            log.info("proxy: stopped")
            return 0
        finally:
            if orphan is not None:
                orphan.cancel()


async def _serve_workers(config: ProxyConfig, path: str, pinned: bool) -> int:
    """The supervisor of ``config.workers`` proxy processes (``pinned``: --workers was given)."""
    supervisor = Supervisor("proxy", path, config.workers, name="proxy",
                            stop_timeout=config.shutdown_timeout + STOP_GRACE + 5.0, listens=config.listens)

    async def hangup() -> None:
        supervisor.reload()  # each worker re-reads the file and keeps its settings if it is invalid
        with contextlib.suppress(GeolimitError):
            workers = load_proxy_config(path).workers
            if not pinned and workers != config.workers:
                log.warning("proxy: proxy.workers changed from %d to %d: restart the proxy to apply it",
                            config.workers, workers)

    with process_signals(hangup) as stop:
        return await supervisor.serve(stop)


def run_proxy(config_path: str, workers: int | None = None, worker_index: int | None = None) -> int:
    """Run the proxy of ``config_path`` until SIGTERM/SIGINT; the process exit code.

    A bad file raises :class:`~geolimit.errors.ConfigError` (the CLI prints it and
    exits 1). ``workers`` overrides ``[proxy] workers``; with more than one, this
    process supervises that many proxy processes, each run with its ``worker_index``.
    """
    config = load_proxy_config(config_path)
    if workers is not None:
        config = with_workers(config, workers)
    if worker_index is not None and not 0 <= worker_index < config.workers:
        raise ConfigError(f"--worker-index must be from 0 to {config.workers - 1}, got {worker_index}")
    configure_logging(config.log_format, config.log_level, worker_index if config.workers > 1 else None)
    if worker_index is None and config.workers > 1:
        return asyncio.run(_serve_workers(config, config_path, workers is not None))
    return run_event_loop(_serve(config, config_path, worker_index))  # uvloop when installed

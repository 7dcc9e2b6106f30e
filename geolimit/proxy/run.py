"""Running the proxy as a process: ``geolimit proxy --config proxy.toml``.

SIGTERM / SIGINT: stop accepting, let in-flight requests finish for up to
``shutdown_timeout`` seconds (then cancel them), exit 0. SIGHUP: re-read the
file; a file that does not validate is logged and the running configuration
stays. Exit 1 when the proxy cannot start (bad config, port in use).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from geolimit.errors import GeolimitError
from geolimit.http.listener import run_event_loop
from geolimit.process import configure_logging, process_signals
from geolimit.proxy.config import ProxyConfig, load_proxy_config
from geolimit.proxy.server import Proxy

__all__ = ["run_proxy"]

log = logging.getLogger("geolimit.proxy")

#: Seconds a stop may take beyond shutdown_timeout (closing pools and connections).
STOP_GRACE = 5.0


async def _reload(proxy: Proxy, path: str) -> None:
    try:
        config = load_proxy_config(path)
        summary = await proxy.reload(config)
    except GeolimitError as exc:
        proxy.metrics.reload("refused")
        log.error("proxy: reload of %s refused, keeping the running configuration: %s", path, exc)
        return
    proxy.metrics.reload("ok")
    log.info("proxy: reloaded %s (%s)", path, summary)


async def _serve(config: ProxyConfig, path: str) -> int:
    proxy = Proxy(config)
    with process_signals(lambda: _reload(proxy, path)) as stop:
        try:
            await proxy.start()
        except (GeolimitError, OSError) as exc:
            print(f"geolimit: error: proxy failed to start: {exc}", file=sys.stderr)
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


def run_proxy(config_path: str) -> int:
    """Run the proxy of ``config_path`` until SIGTERM/SIGINT; the process exit code.

    A bad file raises :class:`~geolimit.errors.ConfigError` (the CLI prints it and exits 1).
    """
    config = load_proxy_config(config_path)
    configure_logging(config.log_format, config.log_level)
    return run_event_loop(_serve(config, config_path))  # uvloop when installed

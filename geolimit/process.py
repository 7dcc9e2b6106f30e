"""Running a geolimit server as a process (the agent, the proxy): logging and signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "process_signals"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line (with ``"worker": i`` in a worker process)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "text", level: str = "INFO", worker: int | None = None) -> None:
    """Log to stderr in ``fmt`` ("text" or "json"), naming the ``worker`` process if given.

    The handler sits on the root logger so that aiohttp's and asyncio's messages
    come out in the same format (one JSON object per line with ``fmt="json"``);
    ``level`` applies to geolimit's loggers, the others log warnings and above.
    """
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = "" if worker is None else f" [worker {worker}]"
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    ours = logging.getLogger("geolimit")
    ours.handlers.clear()
    ours.setLevel(level)
    ours.propagate = True


@contextlib.contextmanager
def process_signals(on_hangup: Callable[[], Coroutine[Any, Any, None]] | None) -> Iterator[asyncio.Event]:
    """SIGTERM/SIGINT set the yielded event; SIGHUP runs ``on_hangup`` (a reload) as a task."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloads: set[asyncio.Task[None]] = set()

    def hangup() -> None:
        if on_hangup is not None:
            task = loop.create_task(on_hangup())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

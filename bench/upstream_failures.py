"""Failing upstreams under load: how many lines does the proxy log?

    python bench/upstream_failures.py [--requests 2000] [--concurrency 50] [--kinds refused closed silent]
                                      [--source DIR] [--logs DIR]

One embedded redis-server, failing upstreams served by this process on loopback and,
for each kind of failure and each path (the fast path, ``fast_path = false``), one
``geolimit proxy`` process (library mode, one rule with a huge limit on every path,
``timeout = 0.2``) in front of that upstream:

* ``refused``: a port where nothing listens (502, ``connect``);
* ``closed``: an upstream that accepts and closes at once (502, ``protocol``);
* ``silent``: an upstream that reads the request and never answers (504, ``timeout``).

``--requests`` GETs are sent, ``--concurrency`` at a time. The figures: the answers'
status codes, ``geolimit_proxy_upstream_errors_total`` and
``geolimit_proxy_responses_total`` from the admin listener, and the proxy's log
lines from the end of its start to the end of the load ("during") and to its exit
after SIGTERM ("with stop"; the held-back count is written then). ``--source`` runs
the proxy from another checkout (``git worktree add /tmp/before HEAD~1``: the same
load before a change); ``--logs DIR`` keeps each proxy's log. Stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy import proxy_toml  # bench/proxy.py

from geolimit.store.embedded import EmbeddedRedis

KINDS = ("refused", "closed", "silent")


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def failing_upstream(kind: str) -> tuple[asyncio.Server, int]:
    """``closed``: accept and close; ``silent``: read and never answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if kind == "closed":
            writer.transport.abort()
            return
        while await reader.read(65536):  # until the proxy gives up and closes
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=1024)
    return server, int(server.sockets[0].getsockname()[1])


class ProxyProcess:
    """``geolimit proxy`` from ``source``; its stderr collected line by line by a thread."""

    def __init__(self, folder: Path, source: Path, upstream: str, redis_url: str, fast_path: bool) -> None:
        config = folder / "proxy.toml"
        config.write_text(proxy_toml(upstream, redis_url, fast_path=fast_path, extra="timeout = 0.2\n"))
        env = dict(os.environ, PYTHONPATH=str(source))
        self.proc = subprocess.Popen([sys.executable, "-m", "geolimit.cli", "proxy", "--config", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=source, env=env)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(30):
            self.proc.kill()
            raise SystemExit("the proxy did not start:\n" + "".join(self.lines))
        found = re.search(r"listening on (http://\S+) \(admin: (http://[0-9.:]+)", self.lines[-1])
        assert found is not None
        self.url, self.admin = found.group(1), found.group(2)
        self.started = len(self.lines)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._listening.set()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.admin + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        wanted = ("geolimit_proxy_upstream_errors_total{", "geolimit_proxy_responses_total{")
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith(wanted)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)


async def load(url: str, requests: int, concurrency: int) -> collections.Counter[int | str]:
    """The answers' status codes (``dropped``: the connection closed with no answer)."""
    statuses: collections.Counter[int | str] = collections.Counter()
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            try:
                async with session.get(url + "/api/items") as resp:
                    await resp.read()
                    statuses[resp.status] += 1
            except aiohttp.ServerDisconnectedError:
                statuses["dropped"] += 1

    timeout = aiohttp.ClientTimeout(total=30)
    # no retry of an idempotent request on a dropped kept-alive connection: each answer is the proxy's
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return statuses


async def scenario(kind: str, fast_path: bool, args: argparse.Namespace, redis_url: str, folder: Path) -> None:
    server = None
    if kind == "refused":
        port = dead_port()
    else:
        server, port = await failing_upstream(kind)
    proxy = ProxyProcess(folder, args.source, f"http://127.0.0.1:{port}", redis_url, fast_path)
    try:
        started = time.monotonic()
        statuses = await load(proxy.url, args.requests, args.concurrency)
        took = time.monotonic() - started
        during = len(proxy.lines) - proxy.started
        figures = await asyncio.get_running_loop().run_in_executor(None, proxy.metrics)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, proxy.stop)
        if server is not None:
            server.close()
    stopped = [line for line in proxy.lines[proxy.started:] if "proxy: stop" not in line]
    path = "fast path" if fast_path else "aiohttp path"
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{kind}-{'fast' if fast_path else 'aiohttp'}.log").write_text("".join(proxy.lines))
    print(f"\n== {kind}, {path}: {args.requests} requests in {took:.2f} s; answers {dict(sorted(statuses.items(), key=str))}")
    for name, value in sorted(figures.items()):
        if "upstream" in name or 'code="5' in name:
            print(f"   {name} {value:.0f}")
    print(f"   log lines: {during} during the load, {len(stopped)} with the stop (proxy: stopping/stopped not counted)")
    for line in stopped[:3]:
        print("   | " + line.rstrip()[:300])
    if len(stopped) > 3:
        print(f"   | ... ({len(stopped) - 3} more)")
        print("   | " + stopped[-1].rstrip()[:300])


async def main(args: argparse.Namespace) -> None:
    redis_server = EmbeddedRedis().start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for kind in args.kinds:
                for fast_path in (True, False):
                    await scenario(kind, fast_path, args, redis_server.url, Path(tmp))
    finally:
        redis_server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout the proxy runs from")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the failures to try")
    parser.add_argument("--logs", type=Path, help="write each proxy's whole log to a file in this folder")
    asyncio.run(main(parser.parse_args()))

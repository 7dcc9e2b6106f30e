"""Half-sent request heads against one agent: how many file descriptors do they hold, and for how long?

    python bench/heads.py [--connections 2000] [--seconds 15] [--nofile N] [--sustain] [--source DIR]

One embedded redis-server and one ``geolimit agent`` process (region ``a``, no peers,
every setting its default) on loopback. After a baseline (the agent's open file
descriptors from ``/proc/PID/fd`` and ``/v1/check`` latency every 50 ms for 2 s, from
a client opening a new connection for each probe and from one keeping its connection),
``--connections`` raw sockets each send half a request line (``GET /v1/sta``) and
never send the rest (``--sustain``: one that the agent closes is opened again at once).
For ``--seconds`` the agent's descriptors are sampled and ``/v1/check`` probed as
before; the figures are the descriptors held, the probes' latency and failures, and
when the agent closed the half-sent connections. ``--nofile`` starts the agent with
that RLIMIT_NOFILE; ``--source`` runs the agent from another checkout (``git worktree
add /tmp/before HEAD~1``: the same load before a change). Stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit.store.embedded import EmbeddedRedis

HALF_HEAD = b"GET /v1/sta"
PROBE = {"rule": "api", "subject": "probe"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


def start_agent(folder: Path, redis_url: str, source: Path, nofile: int | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    secret = folder / "gossip.key"
    secret.touch(mode=0o600)
    secret.write_text(secrets.token_hex(32) + "\n")
    config = folder / "a.toml"
    config.write_text(f'[region]\nname = "a"\nredis_url = "{redis_url}"\nlisten = "127.0.0.1:{port}"\n'
                      f'secret_file = "{secret}"\n[gossip]\npeers = []\n'
                      '[[rule]]\nname = "api"\nlimit = "1000000/10s"\nresolution = "1s"\n')

    def limits() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, max(nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))

    env = dict(os.environ, PYTHONPATH=str(source))
    with (folder / "a.log").open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "geolimit", "agent", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=source, env=env,
                                preexec_fn=limits)
    return proc, f"http://127.0.0.1:{port}"


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


async def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent not ready (exit {proc.returncode}): {tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)


async def probe(url: str, until: float, fresh: bool = True) -> list[float]:
    """``/v1/check`` every 50 ms, on a new connection each time or on one kept alive (inf: failed or over 5 s)."""
    out = []
    connector = aiohttp.TCPConnector(force_close=fresh)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < until:
            t = time.monotonic()
            try:
                async with http.post(url + "/v1/check", json=PROBE) as resp:
                    await resp.read()
                    ok = resp.status == 200
                out.append(time.monotonic() - t if ok else float("inf"))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                out.append(float("inf"))
            await asyncio.sleep(0.05)
    return out


async def sample(pid: int, until: float, every: float = 0.25) -> list[tuple[float, int]]:
    started = time.monotonic()
    out = []
    while time.monotonic() < until:
        out.append((time.monotonic() - started, fds(pid)))
        await asyncio.sleep(every)
    return out


async def half_heads(url: str, n: int, until: float, sustain: bool) -> tuple[int, list[float]]:
    """Open ``n`` connections sending half a request line; (opened, seconds until the agent closed each)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    closed: list[float] = []

    async def one() -> int:
        opened = 0
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
            except (OSError, asyncio.TimeoutError):
                return opened
            opened += 1
            writer.write(HALF_HEAD)
            try:
                await asyncio.wait_for(reader.read(65536), max(0.0, until - time.monotonic()))
                closed.append(time.monotonic() - started)  # the agent answered or closed it
            except (OSError, asyncio.TimeoutError):
                closed.append(time.monotonic() - started)  # reset
            finally:
                writer.transport.abort()
            if not sustain:
                break
        return opened

    opened = sum(await asyncio.gather(*(one() for _ in range(n))))
    return opened, [t for t in closed if t < until - started]


async def run(connections: int, seconds: float, nofile: int | None, sustain: bool, source: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="geolimit-heads-") as folder, EmbeddedRedis() as redis_server:
        proc, url = start_agent(Path(folder), redis_server.url, source, nofile)
        try:
            await wait_ready(proc, url, Path(folder) / "a.log")
            idle = fds(proc.pid)
            base, base_kept = await asyncio.gather(probe(url, time.monotonic() + 2),
                                                   probe(url, time.monotonic() + 2, fresh=False))
            until = time.monotonic() + seconds
            (opened, closed), samples, under, kept = await asyncio.gather(
                half_heads(url, connections, until, sustain), sample(proc.pid, until), probe(url, until),
                probe(url, until, fresh=False))
            after = fds(proc.pid)
            log = (Path(folder) / "a.log").read_text(errors="replace").splitlines()
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"idle": idle, "base": base, "base_kept": base_kept, "opened": opened, "closed": closed,
            "samples": samples, "under": under, "kept": kept, "after": after, "log_lines": len(log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the half-sent heads are held open")
    parser.add_argument("--nofile", type=int, default=None, help="the agent's RLIMIT_NOFILE (default: inherited)")
    parser.add_argument("--sustain", action="store_true", help="open a half-sent head again when one is closed")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose geolimit the agent runs")
    args = parser.parse_args()
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit < args.connections + 200:
        raise SystemExit(f"this process may open {limit} files: raise ulimit -n above {args.connections + 200}")
    r = asyncio.run(run(args.connections, args.seconds, args.nofile, args.sustain, args.source.resolve()))

    def lat(xs: list[float]) -> str:
        ok = [x for x in xs if x != float("inf")]
        failed = len(xs) - len(ok)
        if not ok:
            return f"n={len(xs)}, all failed"
        return (f"n={len(xs)} p50 {quantile(ok, 0.5) * 1e3:.1f} ms, p99 {quantile(ok, 0.99) * 1e3:.1f} ms, "
                f"max {max(ok) * 1e3:.1f} ms, failed {failed}")

    peak = max((n for _, n in r["samples"]), default=-1)
    at = {s: next((n for t, n in r["samples"] if t >= s), -1) for s in (1, 5, 9, 11, 14)}
    closed = r["closed"]
    print(f"agent from {args.source} (RLIMIT_NOFILE {args.nofile or 'inherited'}): {args.connections} half-sent "
          f"heads ({HALF_HEAD.decode()!r}{', reopened when closed' if args.sustain else ''}) for {args.seconds:g} s")
    print(f"agent fds idle: {r['idle']}; peak {peak}; at " +
          ", ".join(f"{s} s: {n}" for s, n in at.items()) + f"; after: {r['after']} ({len(r['samples'])} samples)")
    print(f"half-sent connections opened: {r['opened']}; closed by the agent: {len(closed)}" +
          (f" (first at {min(closed):.2f} s, median {quantile(closed, 0.5):.2f} s, last {max(closed):.2f} s)"
           if closed else ""))
    print(f"/v1/check, a new connection each, before: {lat(r['base'])}")
    print(f"                                  during: {lat(r['under'])}")
    print(f"/v1/check, one kept-alive connection, before: {lat(r['base_kept'])}")
    print(f"                                      during: {lat(r['kept'])}")
    print(f"agent log lines: {r['log_lines']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

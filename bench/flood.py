"""A signed peer floods one agent with big messages: how long do its decisions wait?

    python bench/flood.py [--seconds 20] [--senders 3] [--cells 65536]

Three regions (embedded redis-servers, one `geolimit agent` process each, on
loopback). For ``--seconds``, ``--senders`` concurrent senders post signed
deltas forged as region a to region b's agent, each message holding ``--cells``
cells spread over b's 64 shards (65,536 cells, 1.3 MB with the defaults): what a
compromised or buggy peer can send within the size cap. Meanwhile a prober asks
b's ``/v1/check`` every 50 ms. The baseline is the same prober on the same agent
in the same run before the flood. Figures: the probe's latency quantiles, the
messages merged, and their median time. Stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _agents import start_agent_processes, stop_process, wait_agents_ready
from _common import quantile

from geolimit.core.keys import KeyLayout
from geolimit.core.window import SUBSTEPS
from geolimit.replication import wire
from geolimit.replication.auth import Signer
from geolimit.replication.redis_io import pack_blob
from geolimit.store.embedded import EmbeddedRedis
from geolimit.toml_config import read_secret

RULES = '[[rule]]\nname = "api"\nlimit = "1000/10s"\nresolution = "1s"\n'
API_STRUCTURE = (10_000_000, 1_000_000, 0)


def subjects_by_shard(shards: int, per_shard: int) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {s: [] for s in range(shards)}
    i = 0
    while min(len(v) for v in out.values()) < per_shard:
        subject = b"f%d" % i
        i += 1
        shard = zlib.crc32(subject) % shards
        if len(out[shard]) < per_shard:
            out[shard].append(subject)
    return out


def message(subjects: dict[int, list[bytes]], n: int, shards: int) -> bytes:
    bucket = int(time.time()) - 1
    blobs = []
    for shard, names in subjects.items():
        cells = [x for _ in names for x in (bucket, 0, SUBSTEPS * (n + 1), 0)]
        blobs.append((shard, pack_blob(["a/flood"], [b"api:" + s for s in names], [1] * len(names), cells)))
    return wire.encode(wire.Message(kind="delta", sender="a", dest="b", rules={"api": API_STRUCTURE},
                                    shards=shards, blobs=blobs, now_us=int(time.time() * 1e6)))


async def probe(http: aiohttp.ClientSession, url: str, until: float) -> list[float]:
    out = []
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            async with http.post(url + "/v1/check", json={"rule": "api", "subject": "probe"},
                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
            out.append(time.monotonic() - t)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            out.append(float("inf"))
        await asyncio.sleep(0.05)
    return out


async def run(seconds: float, senders: int, cells: int) -> dict[str, Any]:
    shards = KeyLayout().shards
    subjects = subjects_by_shard(shards, cells // shards)
    with tempfile.TemporaryDirectory(prefix="geolimit-flood-") as folder, contextlib.ExitStack() as stack:
        urls = {r: stack.enter_context(EmbeddedRedis()).url for r in "abc"}
        agents = start_agent_processes(Path(folder), urls, RULES)
        try:
            await wait_agents_ready(agents)
            b_url = agents[1].url
            signer = Signer(read_secret(Path(folder) / "gossip.key", "bench"), "a")
            done: dict[str, list[float]] = {}

            async def flood(http: aiohttp.ClientSession, k: int, until: float) -> None:
                n = 0
                while time.monotonic() < until:
                    body = message(subjects, n * senders + k, shards)
                    n += 1
                    t = time.monotonic()
                    try:
                        async with http.post(b_url + "/v1/gossip", data=body, headers=signer.headers(body, "b")) as r:
                            await r.read()
                            done.setdefault(str(r.status), []).append(time.monotonic() - t)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        done.setdefault(type(exc).__name__, []).append(time.monotonic() - t)

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                base = await probe(http, b_url, time.monotonic() + 3)
                stop = time.monotonic() + seconds
                under, *_ = await asyncio.gather(probe(http, b_url, stop + 1),
                                                 *(flood(http, k, stop) for k in range(senders)))
            size = len(message(subjects, 0, shards))
        finally:
            for a in agents:
                stop_process(a.proc)
    return {"base": base, "under": under, "done": done, "bytes": size, "cells": cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--senders", type=int, default=3)
    parser.add_argument("--cells", type=int, default=65536, help="cells in each message (spread over the shards)")
    args = parser.parse_args()
    r = asyncio.run(run(args.seconds, args.senders, args.cells))

    def q(xs: list[float]) -> str:
        return (f"n={len(xs)} p50 {quantile(xs, 0.5) * 1e3:.1f} ms, p99 {quantile(xs, 0.99) * 1e3:.1f} ms, "
                f"max {max(xs) * 1e3:.1f} ms")

    print(f"flood: {args.senders} senders, {r['cells']} cells ({r['bytes'] / 1e6:.1f} MB) a message, {args.seconds:g} s")
    print(f"/v1/check before the flood (baseline): {q(r['base'])}")
    print(f"/v1/check during the flood:            {q(r['under'])}")
    print("messages: " + ", ".join(f"{k}: {len(v)} (median {quantile(v, 0.5):.2f} s)" for k, v in r["done"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

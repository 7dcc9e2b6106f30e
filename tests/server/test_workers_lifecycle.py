"""`geolimit agent --workers 2`, its life cycle: real supervisor and worker processes, two regions, real redis-servers.

Each region runs a supervisor and two workers sharing one port (SO_REUSEPORT).
The test client opens a new connection per request, so the kernel spreads
them over the workers. This file: a supervisor killed, ports held by others, bad
values, shard ownership, the signers, and the Supervisor object with a stand-in worker.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from geolimit.replication.auth import SEQ
from geolimit.server.workers import Supervisor, WorkerSigner, owned_shards
from geolimit.store.embedded import EmbeddedRedis
from geolimit.supervisor import sweep_stale_metrics_dirs
from tests.server.helpers import AgentProcess, cli, dump_toml, region_config, write_secret
from tests.server.workers_support import (
    RULE,
    alive,
    make_regions,
    start,
    statuses,
)
from tests.support.regions import eventually


async def test_workers_stop_when_their_supervisor_is_killed(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    regions = make_regions(tmp_path, {"a": redis_server_factory()}, {"a": 2})
    proc = await start(regions["a"], supervisors)
    seen = await statuses(http, regions["a"], lambda s: len(s) == 2)
    pids = [s["worker"]["pid"] for s in seen.values()]
    proc.proc.send_signal(signal.SIGKILL)
    await eventually(lambda: not any(alive(pid) for pid in pids), timeout=20,
                     what=f"orphaned workers {pids} to stop; log:\n{proc.log}")
    await proc.wait_for_log(r"\[worker [01]\]: the supervisor \(pid \d+\) is gone: this worker stops")
    # The killed supervisor could not remove its workers' metrics directory; the next one does.
    left = (await proc.wait_for_log(r"shared metrics in (\S+)\)")).group(1)
    assert os.path.isdir(left)  # noqa: ASYNC240 - one stat in a test
    again = await start(regions["a"], supervisors)
    await again.wait_for_log(rf"agent a: removed {re.escape(left)}, left by a supervisor that was killed")
    assert not os.path.exists(left)  # noqa: ASYNC240 - one stat in a test
    await statuses(http, regions["a"], lambda s: len(s) == 2)  # the new workers share their own directory


def test_the_sweep_removes_only_directories_of_supervisors_that_are_gone(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(gone.stdout)  # exited and reaped: no process has this pid (unless it is reused meanwhile)
    names = [f"geolimit-agent-metrics-{dead}-x1", f"geolimit-agent-metrics-{os.getpid()}-x2",
             "geolimit-agent-metrics-oldname", f"geolimit-proxy-metrics-{dead}-x3"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "live-1-ab.json").write_text("{}")
    (tmp_path / f"geolimit-agent-metrics-{dead}-file").write_text("not a directory")
    assert sweep_stale_metrics_dirs("agent", str(tmp_path)) == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[1:], f"geolimit-agent-metrics-{dead}-file"])
    assert sweep_stale_metrics_dirs("proxy", str(tmp_path)) == [str(tmp_path / names[3])]


@pytest.mark.parametrize("held", ["region.listen", "region.api_listen"])
async def test_a_port_held_by_another_process_fails_the_supervisor_at_once(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess], held: str,
) -> None:
    """Once, workers that could not bind crash-looped ~14 s; now the supervisor binds the ports first: one
    error line, exit 1, no worker started (the crash-loop give-up: the stand-in worker test below)."""
    regions = make_regions(tmp_path, {"a": redis_server_factory()}, {"a": 2})
    with socket.socket() as squatter:  # holds the port without SO_REUSEPORT: no worker could bind it
        squatter.bind(("127.0.0.1", 0 if held == "region.api_listen" else int(regions["a"].url.rpartition(":")[2])))
        squatter.listen()
        port = int(squatter.getsockname()[1])
        if held == "region.api_listen":  # the [region] table comes first
            config = regions["a"].config
            config.write_text(config.read_text().replace("[gossip]", f'api_listen = "127.0.0.1:{port}"\n[gossip]', 1))
        proc = await start(regions["a"], supervisors)
        assert await proc.wait(timeout=10) == 1  # Python's start-up and the config: ~0.5 s
    assert proc.lines == [f"geolimit: error: agent a: cannot listen on {held} 127.0.0.1:{port}: "
                          "[Errno 98] Address already in use"], proc.log


@pytest.mark.parametrize(("workers", "port", "args", "expected"), [
    pytest.param(0, 7400, (), "region.workers must be an integer from 1 to 64, got 0", id="toml-zero"),
    pytest.param("2", 7400, (), "region.workers must be an integer from 1 to 64, got '2'", id="toml-string"),
    pytest.param(2, 0, (), "region.workers = 2 needs a fixed port in region.listen", id="port-0"),
])
async def test_bad_workers_values_are_config_errors(
    tmp_path: Path, workers: object, port: int, args: tuple[str, ...], expected: str
) -> None:
    """Refused before anything starts (nothing listens on the port or connects to Redis)."""
    write_secret(tmp_path / "gossip.key")
    data = region_config("redis://127.0.0.1:1/0", listen=f"127.0.0.1:{port}", rules=[RULE])
    if workers is not None:
        data["region"]["workers"] = workers
    (tmp_path / "a.toml").write_text(dump_toml(data))
    ran = await cli("agent", "--config", str(tmp_path / "a.toml"), *args)
    assert ran.code == 1, ran
    assert expected in ran.stderr, ran.stderr
    assert ran.stderr.startswith("geolimit: error: "), ran.stderr


def test_workers_own_every_shard_exactly_once() -> None:
    for shards, workers in ((64, 1), (64, 2), (64, 3), (64, 64), (16, 5)):
        owned = [owned_shards(shards, i, workers) for i in range(workers)]
        assert sorted(s for part in owned for s in part) == list(range(shards))
        assert max(map(len, owned)) - min(map(len, owned)) <= 1
    assert owned_shards(8, 1, 2) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="worker index 2"):
        owned_shards(8, 2, 2)


def test_worker_signers_never_pick_the_same_sequence_number() -> None:
    """Two workers of a region sign as the region: the peers' replay guard must see distinct seqs."""
    now = [1_700_000_000.0]
    signers = [WorkerSigner(b"k" * 32, "a", lambda: now[0], index=i, workers=3) for i in range(3)]
    seen: list[int] = []
    for step in range(200):
        now[0] += 0.0000005 * (step % 3)  # often the same microsecond for every worker
        for i, signer in enumerate(signers):
            seq = int(signer.headers(b"body", "b")[SEQ])
            assert seq % 3 == i
            seen.append(seq)
    assert len(set(seen)) == len(seen)
    for i in range(3):
        mine = seen[i::3]
        assert mine == sorted(mine)
        assert mine[0] >= 1_700_000_000 * 1_000_000


STAND_IN = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[sys.argv.index("--config") + 1]).with_suffix("." + sys.argv[sys.argv.index("--worker-index") + 1])
if out.exists():
    sys.exit(3)  # the second start of this worker crashes, and so does every later one
out.write_text("started\\n")
signal.signal(signal.SIGHUP, lambda *_: out.write_text(out.read_text() + "reload\\n"))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


async def test_supervisor_object_forwards_signals_and_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    """The Supervisor with a stand-in worker program (the real agent is tested above): its contract, fast."""
    config = tmp_path / "x.toml"
    sup = Supervisor(config, 2, region="x", first_backoff=0.05, max_crashes=3, crash_window=60.0,
                     command=[sys.executable, "-c", STAND_IN])
    async with sup:
        await eventually(lambda: all((tmp_path / f"x.{i}").exists() for i in range(2)), timeout=20, what="workers")
        sup.reload()
        await eventually(lambda: all("reload" in (tmp_path / f"x.{i}").read_text() for i in range(2)),
                         timeout=20, what="SIGHUP forwarded")
        first = sup.pids
        os.kill(first[1], signal.SIGKILL)  # restarted, then crashes twice more: the supervisor gives up
        assert await asyncio.wait_for(sup.wait(), 20) == 1
        assert sup.failure == "worker 1 exited with code 3; it crashed 3 times within 60s"
        assert sup.restarts == [0, 2]
    assert not alive(first[0])

"""One /metrics scrape describes a whole region run by `geolimit agent --workers 2` (real processes, real Redis).

Region a runs two workers sharing one port; its peer b is configured but never
started, so a's outboxes fill up. Each worker shares a snapshot of its figures
in the supervisor's metrics directory (named in its log); the test reads those
files only to know that both workers made decisions.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp

from geolimit.store.embedded import EmbeddedRedis
from tests.server.helpers import AgentProcess, cli
from tests.server.workers_support import alive, get, hit, make_regions, start, statuses
from tests.support.regions import eventually

Figures = dict[tuple[str, str], float]


def parse(text: str) -> tuple[int, Figures]:
    """(the answering worker, {(sample name, labels text): value}) of a /metrics answer."""
    worker = int(re.search(r'^target_info\{worker="(\d+)",workers="2"\} 1\.0$', text, re.M).group(1))  # type: ignore[union-attr]
    figures = {(m[0], m[1]): float(m[2]) for m in re.findall(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.M)}
    return worker, figures


def total(figures: Figures, name: str) -> float:
    return sum(v for (sample, _), v in figures.items() if sample == name)


def decisions_in_snapshots(directory: str) -> dict[int, float]:
    """geolimit_decisions_total per worker pid, from the live snapshots in the metrics directory."""
    found: dict[int, float] = {}
    for name in os.listdir(directory):
        if name.startswith("live-") and name.endswith(".json"):
            data = json.loads(Path(directory, name).read_text())
            found[int(name.split("-")[1])] = sum(
                s[2] for f in data["families"] if f["name"] == "geolimit_decisions" for s in f["samples"]
                if s[0] == "geolimit_decisions_total")
    return found


async def test_one_scrape_counts_every_workers_decisions_and_outbox_even_after_a_worker_is_killed(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    regions = make_regions(tmp_path, {name: redis_server_factory() for name in "ab"}, {"a": 2})
    a = regions["a"]
    proc = await start(a, supervisors)
    directory = (await proc.wait_for_log(r"agent a: started 2 workers \(pids .*; shared metrics in (\S+)\)")).group(1)
    seen = await statuses(http, a, lambda s: len(s) == 2 and all(x["ready"] for x in s.values()))
    pids = {i: s["worker"]["pid"] for i, s in seen.items()}

    # Decisions through the shared port until both workers have made some.
    hits: Counter[str] = Counter()
    batch = 0

    async def both_decided() -> bool:
        nonlocal batch
        await hit(http, a, hits, [f"user:{batch}:{i}" for i in range(20)], 1)
        batch += 1
        counts = decisions_in_snapshots(directory)
        return all(counts.get(pid, 0) > 0 for pid in pids.values())

    await eventually(both_decided, timeout=30, what="decisions made by both workers")
    made = sum(hits.values())

    async def scrapes_show(decided: float, queued: float, workers: set[int], exact: bool = False) -> None:
        """Scrapes until each of ``workers`` answered one with these region totals (``exact``: every scrape)."""
        answered: dict[int, tuple[float, float, float]] = {}

        async def scrape() -> bool:
            worker, figures = parse(await get(http, a.url + "/metrics"))
            answered[worker] = (total(figures, "geolimit_decisions_total"),
                                total(figures, "geolimit_decision_seconds_count"),
                                figures.get(("geolimit_outbox_cells", 'peer="b"'), -1.0))
            assert answered[worker][0] == decided if exact else answered[worker][0] <= decided, answered
            return all(answered.get(w) == (decided, decided, queued) for w in workers)

        await eventually(scrape, timeout=20, pause=0.1, what=f"scrapes showing {decided} decisions and {queued} "
                         "queued", explain=lambda: f"last seen by worker: {answered}")

    # One key per subject waits in the outbox for b, each in its shard owner's outbox.
    await scrapes_show(made, made, {0, 1})
    # /v1/status of either worker: its own shards' outbox, and the region's in worker.region_peers.
    seen = await statuses(http, a, lambda s: len(s) == 2 and all(
        x["worker"]["region_peers"]["b"]["outbox"] == made for x in s.values()))
    assert sum(x["peers"]["b"]["outbox"] for x in seen.values()) == made
    assert all(x["worker"]["region_peers"]["b"]["last_contact_age"] is None for x in seen.values())  # b never ran
    shown = await cli("status", "--agent", a.url)
    assert "last contact, lag and outbox: all workers" in shown.stdout, shown
    assert re.search(rf"^b\s+never\s+\S+\s+{made}\s", shown.stdout, re.M), shown.stdout

    # A killed worker: its decisions still count (in every scrape: no counter reset), and the
    # restarted worker queues the same outbox.
    os.kill(pids[1], signal.SIGKILL)
    restarted = int((await proc.wait_for_log(r"worker 1 restarted \(pid (\d+)\)")).group(1))
    assert not alive(pids[1])
    await statuses(http, a, lambda s: 1 in s and s[1]["worker"]["pid"] == restarted and s[1]["ready"])
    await scrapes_show(made, made, {0, 1}, exact=True)
    await hit(http, a, hits, [f"late:{i}" for i in range(10)], 2)
    await scrapes_show(made + 20, made + 10, {0, 1})

    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait(timeout=30) == 0, proc.log
    assert os.path.basename(directory) not in os.listdir(os.path.dirname(directory)), "the supervisor left its metrics directory"


async def test_a_single_agent_shares_nothing(
    tmp_path: Path, redis_server_factory: Callable[..., EmbeddedRedis], supervisors: list[AgentProcess],
    http: aiohttp.ClientSession,
) -> None:
    """workers = 1: no supervisor, no metrics directory, no target_info (as before workers existed)."""
    regions = make_regions(tmp_path, {"a": redis_server_factory()}, {})
    a = regions["a"]
    proc = await start(a, supervisors)
    await statuses(http, a, lambda s: 0 in s)
    await hit(http, a, Counter(), ["user:1"], 3)
    text = await get(http, a.url + "/metrics")
    assert "target_info" not in text
    assert re.search(r'^geolimit_decisions_total\{result="allowed",rule="api"\} 3\.0$', text, re.M), text
    assert "shared metrics" not in proc.log

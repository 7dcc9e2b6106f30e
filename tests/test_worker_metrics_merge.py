"""How the workers' metrics combine into one /metrics (geolimit/worker_metrics.py), without processes.

The process tests (tests/server/test_worker_metrics.py, tests/proxy/test_proxy_workers.py)
check the same through real supervisors; these pin each combination rule.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from geolimit.worker_metrics import Family, Sample, SharedMetrics, Snapshot, mark_dead, merge


def family(name: str, kind: str, *samples: tuple[str, dict[str, str], float]) -> Family:
    return Family(name, "help", kind, "", [Sample(n, labels, v) for n, labels, v in samples])


def values(families: list[Family]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_counters_sum_over_every_worker_the_dead_included_and_keep_the_earliest_creation() -> None:
    own = [family("d", "counter", ("d_total", {"rule": "api"}, 5), ("d_created", {"rule": "api"}, 100.0))]
    others = [
        Snapshot([family("d", "counter", ("d_total", {"rule": "api"}, 7), ("d_created", {"rule": "api"}, 90.0),
                         ("d_total", {"rule": "other"}, 1))], written=0.0, live=False),
        Snapshot([family("d", "counter", ("d_total", {"rule": "api"}, 2))], written=0.0),
    ]
    merged = values(merge(own, others, now=1.0))
    assert merged == {("d_total", (("rule", "api"),)): 14, ("d_created", (("rule", "api"),)): 90.0,
                      ("d_total", (("rule", "other"),)): 1}


def test_gauges_combine_over_live_workers_by_their_mode_and_ages_grow_with_the_snapshot_age() -> None:
    own = [family("outbox", "gauge", ("outbox", {"peer": "b"}, 10)),
           family("lag", "gauge", ("lag", {"peer": "b"}, 0.5)),
           family("age", "gauge", ("age", {"peer": "b"}, -1))]
    live = Snapshot([family("outbox", "gauge", ("outbox", {"peer": "b"}, 4)),
                     family("lag", "gauge", ("lag", {"peer": "b"}, 2.0)),
                     family("age", "gauge", ("age", {"peer": "b"}, 3.0))], written=97.0)
    dead = Snapshot([family("outbox", "gauge", ("outbox", {"peer": "b"}, 1000)),
                     family("lag", "gauge", ("lag", {"peer": "b"}, 999.0))], written=50.0, live=False)
    merged = values(merge(own, [live, dead], now=100.0, gauges={"lag": "max", "age": "max"}, ages=("lag", "age")))
    # outbox: 10 + 4 (the dead worker's queue is no one's now); lag: max(0.5, 2 + 3 s old); age: 3 + 3.
    assert merged == {("outbox", (("peer", "b"),)): 14, ("lag", (("peer", "b"),)): 5.0,
                      ("age", (("peer", "b"),)): 6.0}


def test_info_families_are_the_answering_workers_and_histograms_sum_bucket_by_bucket() -> None:
    own = [family("target", "info", ("target_info", {"worker": "0"}, 1)),
           family("h", "histogram", ("h_bucket", {"le": "1.0"}, 1), ("h_bucket", {"le": "+Inf"}, 2),
                  ("h_count", {}, 2), ("h_sum", {}, 3.5))]
    other = Snapshot([family("target", "info", ("target_info", {"worker": "1"}, 1)),
                      family("h", "histogram", ("h_bucket", {"le": "1.0"}, 4), ("h_bucket", {"le": "+Inf"}, 4),
                             ("h_count", {}, 4), ("h_sum", {}, 1.0))], written=0.0)
    merged = values(merge(own, [other], now=0.0))
    assert merged == {("target_info", (("worker", "0"),)): 1, ("h_bucket", (("le", "1.0"),)): 5,
                      ("h_bucket", (("le", "+Inf"),)): 6, ("h_count", ()): 6, ("h_sum", ()): 4.5}


def scrape(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


async def test_workers_sharing_a_directory_render_each_others_figures_and_survive_a_death(tmp_path: Path) -> None:
    """Two 'workers' in one process: each renders both; a dead one's counter stays, its gauge goes."""
    shared = []
    for index in range(2):
        registry = CollectorRegistry()
        Counter("hits", "Hits", ["rule"], registry=registry).labels("api").inc(3 + index)
        Gauge("queue", "Queued", registry=registry).set(10 * (index + 1))
        Histogram("lat", "Latency", buckets=(1.0,), registry=registry).observe(0.5)
        worker = SharedMetrics(registry, str(tmp_path), interval=0.01)
        worker.file = f"{1000 + index}-x.json"  # stands for two pids
        shared.append(worker)
    first = scrape(shared[0].render())  # worker 1 has written nothing yet
    assert first[("hits_total", (("rule", "api"),))] == 3
    second = scrape(shared[1].render())
    assert second[("hits_total", (("rule", "api"),))] == 7
    assert second[("queue", ())] == 30
    assert second[("lat_count", ())] == 2
    shared[1].start()
    await asyncio.sleep(0.05)
    await shared[1].stop()
    mark_dead(str(tmp_path), 1001)
    assert sorted(os.listdir(tmp_path)) == ["dead-1001-x.json", "live-1000-x.json"]
    after = scrape(shared[0].render())
    assert after[("hits_total", (("rule", "api"),))] == 7  # the dead worker's hits still count
    assert after[("queue", ())] == 10  # its queue does not

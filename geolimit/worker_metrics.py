"""One ``/metrics`` for all the worker processes of a supervisor (``--workers N``).

The workers share their listening port (``SO_REUSEPORT``), so a scrape reaches
one of them at random. To make that one scrape describe them all, the
supervisor creates a private directory and names it to its workers in
``GEOLIMIT_WORKER_METRICS_DIR``; each worker then

* writes a snapshot of its whole registry there (JSON, replaced atomically)
  every ``interval`` seconds, on every scrape it answers and when it stops;
* answers a scrape by merging its own live registry with the others' snapshots.

How the families combine (the pure core is :func:`merge`):

* **counters and histograms** are summed over every worker this supervisor has
  run, the dead included (the supervisor renames a dead worker's snapshot
  ``dead-*``, :func:`mark_dead`). A value a scrape reported was written to the
  answering worker's snapshot before the answer left, so a total never
  decreases while the supervisor runs, even when a worker is killed.
  ``*_created`` samples take the earliest time.
* **gauges** combine over the live workers only, each family as declared:
  ``"sum"`` (the default; outbox sizes, requests in flight) or ``"max"``
  (lags, round trips). A family listed in ``ages`` holds seconds since some
  event; a positive value from a snapshot is aged by the snapshot's own age.
* **other families** (``target_info``) are the answering worker's.

The answering worker's figures are current; the others' are at most
``interval`` seconds old. Prometheus's own multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) is not used: the agent's gossip figures and the
proxy's request counters are collected at scrape time from plain Python state,
which that mode does not aggregate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["METRICS_DIR_ENV", "Family", "GaugeMode", "Sample", "SharedMetrics", "Snapshot", "mark_dead", "merge",
           "shared_metrics_dir"]

log = logging.getLogger("geolimit.metrics")

#: The environment variable naming the supervisor's metrics directory to its workers.
METRICS_DIR_ENV = "GEOLIMIT_WORKER_METRICS_DIR"
GaugeMode = Literal["sum", "max"]
_CUMULATIVE = frozenset({"counter", "histogram", "summary"})


def shared_metrics_dir() -> str | None:
    """The directory this worker shares its metrics in (None: not a supervised worker)."""
    return os.environ.get(METRICS_DIR_ENV) or None


# -- the pure core -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class Family:
    name: str
    help: str
    type: str
    unit: str = ""
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot:
    """One worker's families as written at ``written`` (its clock); ``live``: the worker still runs."""

    families: Sequence[Family]
    written: float
    live: bool = True


def families_of(metrics: Iterable[Metric]) -> list[Family]:
    return [Family(m.name, m.documentation, m.type, m.unit,
                   [Sample(s.name, dict(s.labels), float(s.value)) for s in m.samples]) for m in metrics]


def merge(own: Sequence[Family], others: Iterable[Snapshot], now: float,
          gauges: Mapping[str, GaugeMode] | None = None, ages: Collection[str] = ()) -> list[Family]:
    """The families of the answering worker (``own``) combined with the other workers' snapshots."""
    gauges = gauges or {}
    out: dict[str, Family] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Sample]] = {}

    def add(family: Family, live: bool, elapsed: float | None) -> None:
        kind = family.type
        if kind == "gauge" and not live:
            return
        if kind != "gauge" and kind not in _CUMULATIVE and elapsed is not None:  # info: the answering worker's
            return
        if family.name not in out:
            out[family.name] = Family(family.name, family.help, kind, family.unit)
            values[family.name] = {}
        merged = values[family.name]
        mode = gauges.get(family.name, "sum")
        for sample in family.samples:
            value = sample.value
            if elapsed is not None and family.name in ages and value > 0:
                value += elapsed
            key = (sample.name, tuple(sorted(sample.labels.items())))
            seen = merged.get(key)
            if seen is None:
                merged[key] = Sample(sample.name, sample.labels, value)
                continue
            if sample.name.endswith("_created") and kind in _CUMULATIVE:
                value = min(seen.value, value)
            elif kind == "gauge" and mode == "max":
                value = max(seen.value, value)
            else:
                value += seen.value
            merged[key] = Sample(sample.name, seen.labels, value)

    for family in own:
        add(family, True, None)
    for snapshot in others:
        elapsed = max(0.0, now - snapshot.written)
        for family in snapshot.families:
            add(family, snapshot.live, elapsed)
    for name, family in out.items():
        family.samples = list(values[name].values())
    return list(out.values())


def encode(families: Sequence[Family], written: float) -> str:
    return json.dumps({"written": written, "families": [
        {"name": f.name, "help": f.help, "type": f.type, "unit": f.unit,
         "samples": [[s.name, s.labels, s.value] for s in f.samples]} for f in families]})


def decode(text: str, live: bool) -> Snapshot:
    data = json.loads(text)
    return Snapshot([Family(f["name"], f["help"], f["type"], f["unit"],
                            [Sample(name, labels, float(value)) for name, labels, value in f["samples"]])
                     for f in data["families"]], float(data["written"]), live)


# -- the worker's side -------------------------------------------------------------------


class _Families(Collector):
    def __init__(self, families: Sequence[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            metric = Metric(family.name, family.help, family.type, family.unit)
            for sample in family.samples:
                metric.add_sample(sample.name, dict(sample.labels), sample.value)
            yield metric


class SharedMetrics:
    """Shares ``registry`` with the other workers in ``directory`` and renders them all as one.

    ``start()`` begins the periodic snapshots (in the running event loop);
    ``stop()`` writes a last one and ends them. ``render()`` is the merged
    Prometheus text. ``gauges`` and ``ages`` are as in :func:`merge`.
    """

    def __init__(self, registry: Collector, directory: str, *, gauges: Mapping[str, GaugeMode] | None = None,
                 ages: Collection[str] = (), interval: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.directory = directory
        self.gauges = dict(gauges or {})
        self.ages = frozenset(ages)
        self.interval = interval
        self._clock = clock
        self.file = f"{os.getpid()}-{secrets.token_hex(4)}.json"  # a reused pid gets its own file
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    @classmethod
    def for_worker(cls, registry: CollectorRegistry, worker: int, workers: int, *,
                   gauges: Mapping[str, GaugeMode] | None = None, ages: Collection[str] = (),
                   clock: Callable[[], float] = time.time) -> SharedMetrics | None:
        """Worker ``worker`` of ``workers``: labels ``registry``'s target_info with both and
        shares it in the supervisor's directory; None for a single process (nothing shared)."""
        if workers <= 1:
            return None
        registry.set_target_info({"worker": str(worker), "workers": str(workers)})
        directory = shared_metrics_dir()
        if directory is None:  # set by the supervisor
            return None
        return cls(registry, directory, gauges=gauges, ages=ages, clock=clock)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.write(families_of(self.registry.collect()))

    def merged(self) -> list[Family]:
        """Every worker's families combined (this worker's current ones are written out first)."""
        own = families_of(self.registry.collect())
        self.write(own)  # before answering: what a scrape reports is never lost
        return merge(own, self._others(), self._clock(), self.gauges, self.ages)

    def render(self) -> bytes:
        return generate_latest(_Families(self.merged()))

    def write(self, families: Sequence[Family]) -> None:
        path = os.path.join(self.directory, "live-" + self.file)
        temporary = os.path.join(self.directory, ".tmp-" + self.file)
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(encode(families, self._clock()))
            os.replace(temporary, path)
        except OSError as exc:
            if not self._failing:
                log.warning("cannot share this worker's metrics in %s: %s", self.directory, exc)
            self._failing = True
        else:
            self._failing = False

    def _others(self) -> Iterator[Snapshot]:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            live = name.startswith("live-")
            if not (live or name.startswith("dead-")) or not name.endswith(".json") or name[5:] == self.file:
                continue
            snapshot = _read(os.path.join(self.directory, name), live)
            if snapshot is None and live:  # the supervisor marked it dead in the meantime
                snapshot = _read(os.path.join(self.directory, "dead-" + name[5:]), False)
            if snapshot is not None:
                yield snapshot

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.write(families_of(self.registry.collect()))


def _read(path: str, live: bool) -> Snapshot | None:
    try:
        with open(path, encoding="utf-8") as f:
            return decode(f.read(), live)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable metrics snapshot %s: %s", path, exc)
        return None


def mark_dead(directory: str, pid: int) -> None:
    """The supervisor's part: worker ``pid`` exited; its gauges no longer count, its counters still do."""
    prefix = f"live-{pid}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix) and name.endswith(".json"):
                with contextlib.suppress(OSError):
                    os.replace(os.path.join(directory, name), os.path.join(directory, "dead-" + name[5:]))

"""Prometheus metrics of an agent (one registry per agent, so several can share a process).

With several workers (``geolimit agent --workers N``) every worker shares its
registry with the others (geolimit/worker_metrics.py), and ``/metrics`` of any
worker describes the whole region: counters and histograms are summed over the
workers, ``geolimit_outbox_cells`` too (each worker queues its own shards'
keys), while lags, contact ages and round trips are the largest of the
workers' (the worst link). ``target_info{worker,workers}`` names the worker
that answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from geolimit.http.connections import ListenerGuard
from geolimit.replication.gossip import GossipEngine
from geolimit.worker_metrics import GaugeMode, SharedMetrics

__all__ = ["CONTENT_TYPE", "AgentMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: How the workers' gauges combine into the region's (the others sum).
WORKER_GAUGES: dict[str, GaugeMode] = {
    "geolimit_peer_contact_age_seconds": "max", "geolimit_peer_lag_seconds": "max", "geolimit_peer_rtt_seconds": "max",
    "geolimit_peer_clock_offset_seconds": "max", "geolimit_clock_correction_seconds": "max",
    "geolimit_peer_auth_refused": "max",
}
#: Gauges that are seconds since an event: a worker's snapshot is aged by its own age.
AGE_GAUGES = ("geolimit_peer_contact_age_seconds", "geolimit_peer_lag_seconds")


class _EngineCollector(Collector):
    """Reads the gossip engine's state at scrape time."""

    def __init__(self, engine: Callable[[], GossipEngine | None], clock: Callable[[], float],
                 redis_unreachable: Callable[[], bool]) -> None:
        self._engine = engine
        self._clock = clock
        self._redis_unreachable = redis_unreachable

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "geolimit_redis_unreachable",
            "1 while this agent's last gossip round could not reach its Redis (with workers: how many cannot)",
            value=1 if self._redis_unreachable() else 0,
        )
        engine = self._engine()
        if engine is None:
            return
        now = self._clock()
        age = GaugeMetricFamily("geolimit_peer_contact_age_seconds", "Seconds since the last acknowledged exchange with a peer (-1: never)", labels=["peer"])
        outbox = GaugeMetricFamily("geolimit_outbox_cells", "Keys queued in Redis for a peer (their changed cells wait for its acknowledgement)", labels=["peer"])
        lag = GaugeMetricFamily("geolimit_peer_lag_seconds", "Age of the oldest change a peer has not acknowledged (queued or in flight); while its exchanges fail, at least the time since it acknowledged any", labels=["peer"])
        rtt = GaugeMetricFamily("geolimit_peer_rtt_seconds", "Smoothed round trip of a gossip message to a peer, its merge included (0: none yet)", labels=["peer"])
        sent = CounterMetricFamily("geolimit_gossip_cells_sent", "Cells acknowledged by a peer", labels=["peer"])
        received = CounterMetricFamily("geolimit_gossip_cells_received", "Cells received from a peer", labels=["peer"])
        errors = CounterMetricFamily("geolimit_peer_errors", "Failed exchanges with a peer", labels=["peer"])
        ae = CounterMetricFamily("geolimit_anti_entropy_runs_ok", "Completed anti-entropy exchanges", labels=["peer"])
        offset = GaugeMetricFamily("geolimit_peer_clock_offset_seconds", "Estimated clock of a peer minus this region's (seconds)", labels=["peer"])
        refusals = CounterMetricFamily("geolimit_peer_clock_refusals", "Signed messages from a peer refused because their time was outside the auth window", labels=["peer"])
        auth = CounterMetricFamily("geolimit_peer_auth_refusals", "Exchanges a peer refused for this region's signature (401 auth), or answered unverifiably: another secret_file", labels=["peer"])
        auth_now = GaugeMetricFamily("geolimit_peer_auth_refused", "1 while a peer's latest answer refused this region's signature (a success clears it)", labels=["peer"])
        for peer in engine.peers.values():
            age.add_metric([peer.name], -1.0 if peer.last_ok is None else now - peer.last_ok)
            outbox.add_metric([peer.name], peer.queued)
            lag.add_metric([peer.name], peer.lag(now))
            rtt.add_metric([peer.name], peer.rtt)
            sent.add_metric([peer.name], peer.cells_sent)
            received.add_metric([peer.name], peer.cells_received)
            errors.add_metric([peer.name], peer.errors)
            ae.add_metric([peer.name], peer.ae_ok)
            offset.add_metric([peer.name], peer.skew)
            refusals.add_metric([peer.name], peer.clock_refusals)
            auth.add_metric([peer.name], peer.auth_refusals)
            auth_now.add_metric([peer.name], 1 if peer.auth_refused else 0)
        yield from (age, outbox, lag, rtt, sent, received, errors, ae, offset, refusals, auth, auth_now)
        yield GaugeMetricFamily("geolimit_clock_correction_seconds", "Added to this region's clock to agree with the peers' (the mean clock)", value=engine.clock_correction)
        stats = engine.stats
        yield CounterMetricFamily("geolimit_gossip_rounds", "Gossip rounds run", value=stats["rounds"])
        yield CounterMetricFamily("geolimit_gossip_cells_drained", "Changed local keys queued for the peers", value=stats["drained"])
        yield CounterMetricFamily("geolimit_gossip_cells_relayed", "Keys queued for relay from one peer to another (per target peer)", value=stats["relayed"])
        yield CounterMetricFamily("geolimit_gossip_cells_increased", "Received cells that raised local state", value=stats["increased"])
        dropped = CounterMetricFamily("geolimit_gossip_cells_dropped", "Received cells outside the live window", labels=["reason"])
        dropped.add_metric(["old"], stats["dropped_old"])
        dropped.add_metric(["future"], stats["dropped_future"])
        yield CounterMetricFamily("geolimit_gossip_cells_parked", "Received cells ahead of the clock-skew tolerance, kept until their bucket comes", value=stats["parked"])
        yield CounterMetricFamily("geolimit_gossip_cells_unparked", "Parked cells merged once their bucket came", value=stats["unparked"])
        yield CounterMetricFamily("geolimit_slots_reclaimed", "Slot ids of long-idle incarnations taken back from the shard registries", value=stats["slots_reclaimed"])
        yield CounterMetricFamily("geolimit_junk_keys_repaired", "Shard bookkeeping keys of another type (junk) deleted (and rewritten) by the agent's scripts", value=stats["junk_keys"])
        dropped.add_metric(["unknown_rule"], stats["unknown_rule"])
        yield dropped
        yield CounterMetricFamily("geolimit_gossip_values_skipped", "Stored values that were not exact integers (skipped when packing)", value=stats["bad_values"])
        yield CounterMetricFamily("geolimit_gossip_refused", "Peer messages whose cells were refused (bad input)", value=stats["refused"])
        yield CounterMetricFamily("geolimit_background_task_failures", "Background tasks that failed and were retried", value=engine.task_failures)
        yield GaugeMetricFamily("geolimit_shards_unreachable", "Shards whose Redis (a Cluster node) failed in the last gossip round; the others' gossip goes on", value=len(engine.failed_shards))
        yield CounterMetricFamily("geolimit_redis_data_loss_detected", "Times this region's Redis lost shards' data", value=stats["wipes"])


class AgentMetrics:
    """Metrics owned by one agent (worker ``worker`` of ``workers``)."""

    def __init__(self, engine: Callable[[], GossipEngine | None], clock: Callable[[], float] = time.time, *,
                 worker: int = 0, workers: int = 1, redis_unreachable: Callable[[], bool] = lambda: False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter("geolimit_decisions", "Decisions by rule and result", ["rule", "result"], registry=self.registry)
        self.decision_seconds = Histogram(
            "geolimit_decision_seconds", "Decision latency (HTTP API, including Redis)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=self.registry,
        )
        self.round_seconds = Histogram(
            "geolimit_gossip_round_seconds", "Duration of a gossip round (drain, queue, start sends)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry,
        )
        self.rejected = Counter("geolimit_gossip_rejected", "Gossip requests refused, by reason", ["reason"], registry=self.registry)
        self.connections_dropped = Counter(
            "geolimit_http_connections_dropped", "Connections an HTTP listener closed, by reason: over "
            "max_connections (connection_limit), no complete request head within head_timeout (head_timeout)",
            ["listener", "reason"], registry=self.registry)
        self.checks_shed = Counter(
            "geolimit_checks_shed", "Decision requests (/v1/check, /v1/peek) answered 503 at once because "
            "region.max_checks_in_progress checks were in progress (the agent was overloaded)", registry=self.registry)
        self.checks_in_progress = Gauge("geolimit_checks_in_progress", "Checks (/v1/check, /v1/peek) being decided",
                                        registry=self.registry)
        self.connections_open = Gauge("geolimit_http_connections_open", "Open connections of an HTTP listener",
                                      ["listener"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, clock, redis_unreachable))
        self.shared = SharedMetrics.for_worker(self.registry, worker, workers, gauges=WORKER_GAUGES, ages=AGE_GAUGES,
                                               clock=clock)

    def watch_listener(self, guard: ListenerGuard) -> ListenerGuard:
        """Count the connections ``guard`` closes and show those it holds, by its label."""
        dropped = self.connections_dropped
        guard.dropped = lambda reason: dropped.labels(guard.label, reason).inc()
        self.connections_open.labels(guard.label).set_function(lambda: guard.open)
        return guard

    def start(self) -> None:
        """Begin sharing with the other workers (if any)."""
        if self.shared is not None:
            self.shared.start()

    async def stop(self) -> None:
        if self.shared is not None:
            await self.shared.stop()

    def region_peers(self) -> dict[str, dict[str, float | None]] | None:
        """With several workers, per peer the region's outbox (sum), lag and last contact age (the
        largest: the worst worker's), from every worker's shared figures; else None."""
        if self.shared is None:
            return None
        fields = {"geolimit_outbox_cells": "outbox", "geolimit_peer_lag_seconds": "lag",
                  "geolimit_peer_contact_age_seconds": "last_contact_age"}
        peers: dict[str, dict[str, float | None]] = {}
        for family in self.shared.merged():
            if family.name in fields:
                for sample in family.samples:
                    field = fields[family.name]
                    value = None if sample.value < 0 else round(sample.value, 3)  # -1: never
                    peers.setdefault(sample.labels.get("peer", ""), {})[field] = \
                        int(sample.value) if field == "outbox" else value
        return peers

    def render(self) -> bytes:
        """The Prometheus text: this agent's, or with several workers the region's."""
        return generate_latest(self.registry) if self.shared is None else self.shared.render()

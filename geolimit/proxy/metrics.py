"""Prometheus metrics of one proxy (its own registry, served on the admin listener).

========================================================  =============================================
``geolimit_proxy_decisions_total{route,rule,result}``     per limit: allowed, denied, shadow_denied,
                                                          error_allow, error_deny (Redis/agent down);
                                                          a refused request counts no "allowed" (all-
                                                          or-nothing); a failed limit counts its error_*
``geolimit_proxy_responses_total{route,code}``            responses sent, by route template and status
``geolimit_proxy_upstream_seconds{upstream}``             request sent -> response headers (histogram)
``geolimit_proxy_upstream_errors_total{upstream,kind}``   connect, timeout, protocol, body_aborted
``geolimit_proxy_in_flight``                              requests being handled
``geolimit_proxy_reloads_total{result}``                  SIGHUP reloads: ok, refused
``geolimit_proxy_connections_dropped_total``              aiohttp's connections closed: over the cap
``{listener,reason}``                                     (connection_limit), no head in time (head_timeout)
========================================================  =============================================

Unmatched requests are labelled with route ``""``. The request path only bumps
plain integers (a few per request); they become metric families at scrape time.

With several workers (``geolimit proxy --workers N``) each worker shares its
figures with the others (geolimit/worker_metrics.py): ``/metrics`` of any worker
sums every worker's counters, histograms and requests in flight, and
``target_info{worker,workers}`` names the worker that answered.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from geolimit.http.connections import ListenerGuard
from geolimit.worker_metrics import SharedMetrics

__all__ = ["CONTENT_TYPE", "ProxyMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Histogram:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last slot is +Inf
        self.total = 0.0


class ProxyMetrics(Collector):
    """The figures of one proxy process (worker ``worker`` of ``workers``)."""

    def __init__(self, *, worker: int = 0, workers: int = 1) -> None:
        self.decisions: dict[tuple[str, str, str], int] = {}
        self.responses: dict[tuple[str, int], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.upstream_errors: dict[tuple[str, str], int] = {}
        self.reloads: dict[str, int] = {}
        self.connections_dropped: dict[tuple[str, str], int] = {}
        self.in_flight = 0
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.shared = SharedMetrics.for_worker(self.registry, worker, workers)

    def start(self) -> None:
        """Begin sharing with the other workers (if any)."""
        if self.shared is not None:
            self.shared.start()

    async def stop(self) -> None:
        if self.shared is not None:
            await self.shared.stop()

    # -- request path ------------------------------------------------------------------

    def decision(self, route: str, rule: str, result: str) -> None:
        key = (route, rule, result)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def response(self, route: str, code: int) -> None:
        key = (route, code)
        self.responses[key] = self.responses.get(key, 0) + 1

    def upstream_latency(self, upstream: str, seconds: float) -> None:
        hist = self.latency.get(upstream)
        if hist is None:
            hist = self.latency[upstream] = _Histogram()
        hist.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        hist.total += seconds

    def upstream_error(self, upstream: str, kind: str) -> None:
        key = (upstream, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def reload(self, result: str) -> None:
        self.reloads[result] = self.reloads.get(result, 0) + 1

    def watch_listener(self, guard: ListenerGuard) -> ListenerGuard:
        """Count the connections ``guard`` closes, by its label."""

        def dropped(reason: str) -> None:
            key = (guard.label, reason)
            self.connections_dropped[key] = self.connections_dropped.get(key, 0) + 1

        guard.dropped = dropped
        return guard

    # -- scrape ------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("geolimit_proxy_decisions", "Rate-limit outcomes per route and rule",
                                        labels=["route", "rule", "result"])
        for (route, rule, result), value in list(self.decisions.items()):
            decisions.add_metric([route, rule, result], value)
        responses = CounterMetricFamily("geolimit_proxy_responses", "Responses by route template and status code",
                                        labels=["route", "code"])
        for (route, code), value in list(self.responses.items()):
            responses.add_metric([route, str(code)], value)
        latency = HistogramMetricFamily("geolimit_proxy_upstream_seconds",
                                        "Upstream latency: request sent until response headers", labels=["upstream"])
        for upstream, hist in list(self.latency.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*(str(b) for b in BUCKETS), "+Inf"), hist.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([upstream], buckets, hist.total)
        errors = CounterMetricFamily("geolimit_proxy_upstream_errors", "Failed upstream exchanges by kind",
                                     labels=["upstream", "kind"])
        for (upstream, kind), value in list(self.upstream_errors.items()):
            errors.add_metric([upstream, kind], value)
        reloads = CounterMetricFamily("geolimit_proxy_reloads", "Configuration reloads", labels=["result"])
        for result, value in list(self.reloads.items()):
            reloads.add_metric([result], value)
        dropped = CounterMetricFamily("geolimit_proxy_connections_dropped", "Connections aiohttp's listeners closed: "
                                      "over the cap (connection_limit), no request head in time (head_timeout)",
                                      labels=["listener", "reason"])
        for (listener, reason), value in list(self.connections_dropped.items()):
            dropped.add_metric([listener, reason], value)
        yield from (decisions, responses, latency, errors, reloads, dropped)
        yield GaugeMetricFamily("geolimit_proxy_in_flight", "Requests being handled", value=self.in_flight)

    def render(self) -> bytes:
        """The Prometheus text: this process's, or with several workers all of theirs."""
        return generate_latest(self.registry) if self.shared is None else self.shared.render()

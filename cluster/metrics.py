"""Prometheus metrics of the gateway: request latencies measured where the client sees them,
and per-instance state read from the cluster at scrape time."""

from __future__ import annotations

from collections import Counter as Counter_
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# Per-instance gauges: metric name -> (help, function of one instance's stats).
_GAUGES: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "pdcluster_kv_usage_ratio": (
        "Fraction of the instance's KV blocks in use",
        lambda s: (
            1.0 - s["num_blocks_free"] / s["num_blocks_total"] if s.get("num_blocks_total") else 0.0
        ),
    ),
    "pdcluster_num_running": ("Running requests", lambda s: s.get("num_running", 0)),
    "pdcluster_num_waiting": ("Queued requests", lambda s: s.get("num_waiting", 0)),
    "pdcluster_num_deferred": (
        "Requests deferred (encoder output or remote KV in flight)",
        lambda s: s.get("num_deferred", 0),
    ),
    "pdcluster_num_pending_transfers": (
        "KV sends awaiting an ack plus KV loads in flight",
        lambda s: s.get("num_pending_sends", 0) + s.get("num_pending_recvs", 0),
    ),
    "pdcluster_instance_healthy": (
        "1 when this gateway replica sees the instance healthy",
        lambda s: float(s.get("healthy", False)),
    ),
}
# Per-instance counters kept by the instances themselves.
_COUNTERS: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "pdcluster_kv_transfer_bytes": (
        "KV bytes published (P) or loaded (D)",
        lambda s: s.get("bytes_sent", 0) + s.get("bytes_received", 0),
    ),
    "pdcluster_ec_transfer_bytes": (
        "Encoder-output bytes loaded",
        lambda s: s.get("ec_bytes_loaded", 0),
    ),
    "pdcluster_kv_leases_expired": (
        "KV sends freed by lease expiry",
        lambda s: s.get("leases_expired", 0),
    ),
    "pdcluster_kv_transfers": ("KV loads completed", lambda s: s.get("num_loads", 0)),
}


class _InstanceCollector(Collector):
    """Reads the last cluster snapshot (refreshed by the gateway before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: list[dict[str, Any]] = []
        self.planner: dict[str, Any] = {}  # the pool controller's planner_state()

    def collect(self) -> Iterable[Metric]:
        yield from self._pool()
        labels = ["instance", "role"]
        for name, (help_text, fn) in _GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for s in self.snapshot:
                family.add_metric([str(s.get("id")), str(s.get("role"))], float(fn(s)))
            yield family
        for name, (help_text, fn) in _COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=labels)
            for s in self.snapshot:
                family.add_metric([str(s.get("id")), str(s.get("role"))], float(fn(s)))
            yield family
        yield self._transfer_latency(labels)

    def _pool(self) -> Iterable[Metric]:
        """Instances per role (live, and what the planner wants) and its decisions."""
        live = Counter_(s.get("role") for s in self.snapshot if s.get("healthy"))
        desired = self.planner.get("desired", {})
        actual = GaugeMetricFamily("pdcluster_instances", "Live instances", labels=["role"])
        wanted = GaugeMetricFamily(
            "pdcluster_instances_desired",
            "Instances the planner wants (the configured count without a planner)",
            labels=["role"],
        )
        for role in sorted(set(live) | set(desired)):
            actual.add_metric([role], float(live.get(role, 0)))
            wanted.add_metric([role], float(desired.get(role, live.get(role, 0))))
        decisions = CounterMetricFamily(
            "pdcluster_planner_decisions", "Scaling decisions", labels=["role", "direction"]
        )
        for role, direction, count in self.planner.get("decisions", []):
            decisions.add_metric([role, direction], float(count))
        yield from (actual, wanted, decisions)

    def _transfer_latency(self, labels: list[str]) -> HistogramMetricFamily:
        """KV load latency on each decode instance, from its connector's histogram."""
        family = HistogramMetricFamily(
            "pdcluster_kv_transfer_latency_seconds",
            "KV load latency on the consumer (start of load to copied into blocks)",
            labels=labels,
        )
        for s in self.snapshot:
            h = s.get("transfer_ms_histogram")
            if not h:
                continue
            buckets = [(str(ms / 1e3), float(n)) for ms, n in zip(h["buckets_ms"], h["counts"])]
            buckets.append(("+Inf", float(h["count"])))
            family.add_metric(
                [str(s.get("id")), str(s.get("role"))], buckets, sum_value=h["sum_ms"] / 1e3
            )
        return family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdcluster_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "pdcluster_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "pdcluster_e2e_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "pdcluster_requests", "Finished requests", ["finish_reason"], registry=r
        )
        self.generated_tokens = Counter(
            "pdcluster_generated_tokens", "Tokens generated", registry=r
        )
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "Prompt tokens", registry=r)
        self.instances = _InstanceCollector()
        r.register(self.instances)

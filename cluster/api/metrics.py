"""Prometheus metrics of the gateway: request latencies measured where the client sees them,
and per-instance state read from the cluster at scrape time.

Request and engine metrics carry vLLM's names, types and `model_name` label (per instance:
also `engine`, the instance id, and `role`), so that vLLM's dashboards read them; what vLLM
has no name for (transfers, leases, instances, the planner, HTTP statuses) is `pdcluster_*`.
Histograms use vLLM's bucket boundaries, with finer ones below them where ours are fast.
"""

from __future__ import annotations

import time
from collections import Counter as Counter_
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdcluster.actors import instance_metrics
from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_messages import KVPoolStats, PlannerState
from pdcluster.connectors.stats import LatencyHistogram
from pdcluster.engine.outputs import EngineCoreOutput

FINE_BUCKETS_S = (0.001, 0.0025, 0.005)
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = FINE_BUCKETS_S + (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS_S = FINE_BUCKETS_S + (0.01, 0.05, 0.1) + (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# Per-instance series of ours: metric name -> (help, function of one instance's stats).
_GAUGES: dict[str, tuple[str, Callable[[InstanceStats], float]]] = {
    "pdcluster_num_deferred": (
        "Requests deferred (encoder output or remote KV in flight)",
        lambda s: s.scheduler.num_deferred,
    ),
    "pdcluster_num_pending_transfers": (
        "KV sends awaiting an ack plus KV loads in flight",
        lambda s: s.num_pending_transfers,
    ),
}
_COUNTERS: dict[str, tuple[str, Callable[[InstanceStats], float]]] = {
    "pdcluster_kv_transfer_bytes": (
        "KV bytes published (P) or loaded (D)",
        lambda s: s.kv_transfer.bytes_sent + s.kv_transfer.bytes_received,
    ),
    "pdcluster_ec_transfer_bytes": (
        "Encoder-output bytes loaded",
        lambda s: s.ec.bytes_loaded,
    ),
    "pdcluster_kv_leases_expired": (
        "KV sends freed by lease expiry",
        lambda s: s.kv_transfer.leases_expired,
    ),
    "pdcluster_kv_transfers": ("KV loads completed", lambda s: s.kv_transfer.num_loads),
    "pdcluster_kv_checksum_failures": (
        "KV loads (P->D handoffs and cluster KV pool loads) whose bytes did not match their "
        "producer's checksums (recomputed, never served)",
        lambda s: s.kv_transfer.checksum_failures + s.kv_pool.checksum_failures,
    ),
    "pdcluster_ec_checksum_failures": (
        "Encoder outputs whose bytes did not match their checksums (encoded here instead)",
        lambda s: s.ec.checksum_failures,
    ),
    "pdcluster_kv_acks_refused": (
        "KV acks naming another incarnation (epoch) of this instance, refused",
        lambda s: s.kv_transfer.acks_refused,
    ),
    "pdcluster_spec_decode_num_catch_up_tokens": (
        "Known tokens a draft model was fed before drafting (a prompt whose draft KV did not "
        "come with its handoff, a request after a preemption, a fully accepted step's last)",
        lambda s: s.spec_decode.num_catch_up_tokens if s.spec_decode else 0,
    ),
    "pdcluster_kv_pool_hits": (
        "Requests that found further blocks in the cluster KV pool",
        lambda s: s.kv_pool.hits,
    ),
    "pdcluster_kv_pool_hit_tokens": (
        "Tokens loaded from the cluster KV pool instead of computed",
        lambda s: s.kv_pool.hit_tokens,
    ),
    "pdcluster_kv_pool_misses": (
        "Lookups in the cluster KV pool that found nothing further",
        lambda s: s.kv_pool.misses,
    ),
    "pdcluster_kv_pool_failed_loads": (
        "Loads from the cluster KV pool that failed (recomputed)",
        lambda s: s.kv_pool.failed_loads,
    ),
    "pdcluster_kv_pool_published_bytes": (
        "KV bytes this instance published to the cluster KV pool",
        lambda s: s.kv_pool.bytes_published,
    ),
}
# The cluster KV pool's own series: metric name -> (kind, help, function of its stats).
_KV_POOL: dict[str, tuple[type, str, Callable[[KVPoolStats], float]]] = {
    "pdcluster_kv_pool_bytes": (
        GaugeMetricFamily, "Bytes the cluster KV pool holds", lambda p: p.num_bytes,
    ),
    "pdcluster_kv_pool_capacity_bytes": (
        GaugeMetricFamily, "The cluster KV pool's capacity", lambda p: p.capacity_bytes,
    ),
    "pdcluster_kv_pool_entries": (
        GaugeMetricFamily, "Objects (runs of blocks) the cluster KV pool holds",
        lambda p: p.num_entries,
    ),
    "pdcluster_kv_pool_blocks": (
        GaugeMetricFamily, "KV blocks the cluster KV pool holds", lambda p: p.num_blocks,
    ),
    "pdcluster_kv_pool_evictions": (
        CounterMetricFamily, "Entries evicted from the cluster KV pool",
        lambda p: p.num_evictions,
    ),
    "pdcluster_kv_pool_refused_releases": (
        CounterMetricFamily, "Releases naming another incarnation (epoch) of the KV pool",
        lambda p: p.num_refused_releases,
    ),
}  # fmt: skip
_LABELS = ["instance", "role"]
_VLLM_LABELS = list(instance_metrics.TAG_KEYS)


class _InstanceCollector(Collector):
    """Reads the last cluster snapshot (refreshed by the gateway before each scrape). An
    instance that did not answer shows only in `pdcluster_instance_healthy`: its counters
    are absent for that scrape rather than reset."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[InstanceStats] = []
        self.planner = PlannerState(desired={})  # the pool controller's planner_state()
        self.num_moves = 0  # this replica's migrations so far
        self.kv_pool: KVPoolStats | None = None  # the cluster KV pool's stats
        self.gcs_reachable = True  # whether Ray's GCS answered this replica

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "pdcluster_gcs_reachable",
            "1 when Ray's GCS answers this gateway replica (while it is down, streams and new "
            "requests go on; scaling waits for it)",
            value=float(self.gcs_reachable),
        )
        yield from self._pool()
        answered = [s for s in self.snapshot if s.reachable]
        healthy = GaugeMetricFamily(
            "pdcluster_instance_healthy",
            "1 when this gateway replica sees the instance healthy",
            labels=_LABELS,
        )
        for s in self.snapshot:
            healthy.add_metric(_labels(s), float(s.healthy))
        yield healthy
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, (help_text, fn) in table.items():
                family = kind(name, help_text, labels=_LABELS)
                for s in answered:
                    family.add_metric(_labels(s), float(fn(s)))
                yield family
        for kind, series in (
            (GaugeMetricFamily, instance_metrics.GAUGES),
            (CounterMetricFamily, instance_metrics.COUNTERS),
        ):
            for one in series:
                family = kind(one.name, one.help, labels=_VLLM_LABELS)
                for s in answered:
                    family.add_metric(self._vllm_labels(s), float(one.value(s)))
                yield family
        yield self._accepted_per_position(answered)
        yield self._lora_requests_info(answered)
        yield _latency(
            "pdcluster_kv_transfer_latency_seconds",
            "KV load latency on the consumer (start of load to copied into blocks)",
            [(s, s.kv_transfer.transfer_ms_histogram) for s in answered],
        )
        yield _latency(
            "pdcluster_kv_pool_load_latency_seconds",
            "Loads from the cluster KV pool (start of load to copied into blocks)",
            [(s, s.kv_pool.load_ms_histogram) for s in answered],
        )
        for name, (kind, help_text, fn) in _KV_POOL.items():
            if self.kv_pool is not None:
                yield kind(name, help_text, value=float(fn(self.kv_pool)))

    def _accepted_per_position(self, answered: list[InstanceStats]) -> CounterMetricFamily:
        """Accepted draft tokens by their position in the draft (0: the first), per instance
        that speculates."""
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels=[*_VLLM_LABELS, "position"],
        )
        for s in answered:
            if s.spec_decode is not None:
                for pos, n in enumerate(s.spec_decode.num_accepted_tokens_per_pos):
                    family.add_metric([*self._vllm_labels(s), str(pos)], float(n))
        return family

    def _lora_requests_info(self, answered: list[InstanceStats]) -> GaugeMetricFamily:
        """vLLM's LoRA info gauge, per instance that serves adapters: the adapters of its
        running and waiting requests (comma-separated) in labels, its snapshot time as the
        value."""
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            labels=[*_VLLM_LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        now = time.time()
        for s in answered:
            if s.lora is not None:
                lora = s.lora
                labels = [str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)]
                family.add_metric([*self._vllm_labels(s), *labels], now)
        return family

    def _vllm_labels(self, s: InstanceStats) -> list[str]:
        return [self.model_name, s.instance_id, s.role]

    def _pool(self) -> Iterable[Metric]:
        """Instances per role (live, and what the planner wants) and its decisions."""
        live = Counter_(s.role for s in self.snapshot if s.healthy)
        desired = self.planner.desired
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
        for d in self.planner.decisions:
            decisions.add_metric([d.role, d.direction], float(d.count))
        yield from (actual, wanted, decisions)
        yield CounterMetricFamily(
            "pdcluster_request_migrations",
            "Streams this gateway replica planned again on live instances (prompt + tokens "
            "sent) after the instance serving them was lost",
            value=self.num_moves,
        )
        if self.planner.round_s is not None:
            yield GaugeMetricFamily(
                "pdcluster_planner_round_seconds",
                "The planner's last round: reading every instance's stats and deciding",
                value=self.planner.round_s,
            )


def _latency(
    name: str,
    help_text: str,
    histograms: list[tuple[InstanceStats, LatencyHistogram | None]],
) -> HistogramMetricFamily:
    """A latency histogram per instance, from the millisecond histogram its stats hold."""
    family = HistogramMetricFamily(name, help_text, labels=_LABELS)
    for s, h in histograms:
        if h is None:
            continue
        buckets = [(str(ms / 1e3), float(n)) for ms, n in zip(h.buckets_ms, h.counts)]
        buckets.append(("+Inf", float(h.count)))
        family.add_metric(_labels(s), buckets, sum_value=h.sum_ms / 1e3)
    return family


def _labels(s: InstanceStats) -> list[str]:
    return [s.instance_id, s.role]


class GatewayMetrics:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: Iterable[float]) -> Histogram:
            """The model's series of a new histogram."""
            family = Histogram(name, help_text, labels, buckets=tuple(buckets), registry=r)
            return family.labels(model_name)

        def counter(name: str, help_text: str) -> Counter:
            """The model's series of a new counter."""
            return Counter(name, help_text, labels, registry=r).labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS_S
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens", ITL_BUCKETS_S
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Per request: decode time over the tokens after the first",
            ITL_BUCKETS_S,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency (aborted ones included)",
            REQUEST_BUCKETS_S,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time the request waited on its first instance before it was scheduled",
            REQUEST_BUCKETS_S,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Time to first token less the queue time",
            REQUEST_BUCKETS_S,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Time from the first token to the last",
            REQUEST_BUCKETS_S,
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", tokens
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that got a first token"
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (abort: the client went away)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in FINISHED_REASONS
        }
        self.http_requests = Counter(
            "pdcluster_http_requests",
            "HTTP responses by endpoint (the route; `other` when none matched), method, status",
            ["endpoint", "method", "status"],
            registry=r,
        )
        self.instances = _InstanceCollector(model_name)
        r.register(self.instances)

    def start(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)


class RequestTimer:
    """One request's latencies as its outputs reach the gateway; `finish` records them once,
    whether the request finished or its client went away."""

    def __init__(self, metrics: GatewayMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start_s = self.last_s = time.perf_counter()
        self.first_s: float | None = None
        self.queue_time_s: float | None = None
        self.num_tokens = 0

    def observe(self, out: EngineCoreOutput) -> None:
        if self.queue_time_s is None and out.queue_time_s is not None:
            self.queue_time_s = out.queue_time_s  # the first instance's: it holds TTFT
        if not out.new_token_ids:
            return
        now, m = time.perf_counter(), self.metrics
        num_gaps, span = len(out.new_token_ids), now - self.last_s
        if self.first_s is None:
            self.first_s = now
            m.ttft.observe(now - self.start_s)
            m.prompt_tokens.inc(self.num_prompt_tokens)
            num_gaps, span = num_gaps - 1, 0.0
        for _ in range(num_gaps):  # tokens that came together share the time since the last
            m.itl.observe(span / num_gaps)
        self.last_s = now
        self.num_tokens += len(out.new_token_ids)
        m.generation_tokens.inc(len(out.new_token_ids))

    def finish(self, finish_reason: str | None) -> None:
        """`finish_reason` None: the client went away (or the request was cancelled)."""
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.start_s)
        m.request_success[finish_reason or "abort"].inc()
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if self.first_s is None:
            return
        ttft = self.first_s - self.start_s
        if self.queue_time_s is not None:
            m.queue.observe(self.queue_time_s)
            m.prefill.observe(max(0.0, ttft - self.queue_time_s))
        m.decode.observe(self.last_s - self.first_s)
        if self.num_tokens > 1:
            m.tpot.observe((self.last_s - self.first_s) / (self.num_tokens - 1))

"""An instance's own series under vLLM's names, exported through Ray's metrics agent
(`ray.util.metrics`), so that a Prometheus scraping the Ray nodes (KubeRay's) sees every
instance without the gateway. Ray's export prefixes `ray_`, cannot carry `:` (vLLM's
`vllm:x` becomes `ray_vllm_x`, as vLLM's own Ray logger names it) and adds `_total` to
counters: `ray_vllm_num_requests_running`, `ray_vllm_prompt_tokens_total`.

The series are read from the stats snapshot the step loop publishes, at most every
RECORD_INTERVAL_S: no per-token work beyond the engine's counters."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.util import metrics

from pdcluster.actors.messages import InstanceStats
from pdcluster.routing.role import Role

RECORD_INTERVAL_S = 0.5
TAG_KEYS = ("model_name", "engine", "role")  # engine: the instance id, as vLLM's label


@dataclass(frozen=True)
class Series:
    name: str  # vLLM's name
    help: str
    value: Callable[[InstanceStats], float]  # of one instance's stats


GAUGES = (
    Series("vllm:num_requests_running", "Requests in the running batch",
           lambda s: s.scheduler.num_running),
    Series("vllm:num_requests_waiting",
           "Requests waiting to be scheduled (deferred ones, on remote KV or encoder "
           "outputs, included)",
           lambda s: s.scheduler.num_waiting + s.scheduler.num_deferred),
    Series("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all)",
           lambda s: s.scheduler.kv_usage),
)  # fmt: skip
# Counters the gateway exports per instance too.
COUNTERS = (
    Series("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens looked up",
           lambda s: s.scheduler.prefix_cache_queries),
    Series("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens found",
           lambda s: s.scheduler.prefix_cache_hits),
    Series("vllm:num_preemptions", "Preemptions by the scheduler",
           lambda s: s.scheduler.num_preemptions),
    Series("vllm:spec_decode_num_drafts", "Drafts verified (a request's draft in one step)",
           lambda s: s.spec_decode.num_drafts if s.spec_decode else 0),
    Series("vllm:spec_decode_num_draft_tokens", "Draft tokens verified",
           lambda s: s.spec_decode.num_draft_tokens if s.spec_decode else 0),
    Series("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
           lambda s: s.spec_decode.num_accepted_tokens if s.spec_decode else 0),
)  # fmt: skip
# Counters only instances export: the gateway counts tokens per request, once.
TOKEN_COUNTERS = (
    Series("vllm:prompt_tokens", "Prompt tokens of requests that produced a first token here",
           lambda s: s.scheduler.num_prompt_tokens),
    Series("vllm:generation_tokens", "Tokens generated here",
           lambda s: s.scheduler.num_generation_tokens),
)  # fmt: skip


def ray_name(name: str) -> str:
    """Ray's metric names allow letters, digits and `_` only."""
    return name.replace(":", "_")


class InstanceMetrics:
    """Ray gauges and counters of one instance, recorded from its stats snapshots."""

    def __init__(self, model_name: str, instance_id: str, role: Role) -> None:
        self._tags = {"model_name": model_name, "engine": instance_id, "role": str(role)}
        self._gauges = [(s, self._make(metrics.Gauge, s)) for s in GAUGES]
        self._counters = [(s, self._make(metrics.Counter, s)) for s in COUNTERS + TOKEN_COUNTERS]
        self._recorded: dict[str, float] = {}  # counter name -> the value recorded so far
        self._gauge_values: dict[str, float] = {}  # gauge name -> its value (Ray keeps it)
        self._next_s = 0.0

    @staticmethod
    def _make(kind: type, series: Series) -> Any:
        return kind(ray_name(series.name), description=series.help, tag_keys=TAG_KEYS)

    def maybe_record(self, stats: InstanceStats) -> None:
        """Record `stats` unless the last recording was under RECORD_INTERVAL_S ago."""
        now = time.monotonic()
        if now < self._next_s:
            return
        self._next_s = now + RECORD_INTERVAL_S
        for series, gauge in self._gauges:
            value = float(series.value(stats))
            if self._gauge_values.get(series.name) != value:  # an idle instance records nothing
                gauge.set(value, tags=self._tags)
                self._gauge_values[series.name] = value
        for series, counter in self._counters:
            value = float(series.value(stats))
            delta = value - self._recorded.get(series.name, 0.0)
            if delta > 0:
                counter.inc(delta, tags=self._tags)
                self._recorded[series.name] = value

"""The connectors' counters, one frozen dataclass per kind of connector: what `stats()` of a
connector returns, what `EngineCore.stats()` carries and what `InstanceStats`
(actors/messages.py) holds, unchanged on the way. No Ray here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LatencyHistogram:
    """Cumulative counts per upper bound (ms), with their sum and count: Prometheus' shape."""

    buckets_ms: tuple[float, ...]
    counts: tuple[int, ...]
    sum_ms: float
    count: int

    @classmethod
    def from_engine(cls, h: Mapping[str, Any]) -> LatencyHistogram:
        return cls(tuple(h["buckets_ms"]), tuple(h["counts"]), h["sum_ms"], h["count"])


@dataclass(frozen=True)
class KVTransferStats:
    """The P->D KV connector's counters (zero on an instance without one)."""

    num_sends: int = 0
    num_loads: int = 0
    num_failed_loads: int = 0
    leases_expired: int = 0
    acks_received: int = 0
    acks_ignored: int = 0
    sends_cancelled: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_transfer_ms: float | None = None
    mean_transfer_ms: float | None = None
    transfer_ms_histogram: LatencyHistogram | None = None
    last_publish_ms: float | None = None
    mean_publish_ms: float | None = None


@dataclass(frozen=True)
class KVPoolUse:
    """This instance's use of the cluster KV pool (zero on an instance without one)."""

    hits: int = 0  # requests that found further blocks there
    misses: int = 0
    hit_tokens: int = 0  # tokens loaded from the pool instead of computed
    loads: int = 0
    failed_loads: int = 0
    publishes: int = 0
    bytes_published: int = 0
    bytes_loaded: int = 0
    pending_loads: int = 0
    load_ms_histogram: LatencyHistogram | None = None
    mean_load_ms: float | None = None
    mean_publish_ms: float | None = None


@dataclass(frozen=True)
class ECStats:
    """The encoder-output connector's counters on a consumer (P, D or mixed)."""

    pending: int = 0  # requests whose encoder outputs are awaited
    loaded: int = 0  # encoder outputs loaded from an E
    fallbacks: int = 0  # encoded here instead
    bytes_loaded: int = 0

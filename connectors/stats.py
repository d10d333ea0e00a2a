"""The connectors' counters, one frozen dataclass per kind of connector: what `stats()` of a
connector returns, what `EngineCore.stats()` carries and what `InstanceStats`
(actors/messages.py) holds, unchanged on the way. No Ray here."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LatencyHistogram:
    """Cumulative counts per upper bound (ms), with their sum and count: Prometheus' shape."""

    buckets_ms: tuple[float, ...]
    counts: tuple[int, ...]
    sum_ms: float
    count: int


@dataclass(frozen=True)
class KVTransferStats:
    """The P->D KV connector's counters (zero on an instance without one)."""

    num_sends: int = 0
    num_loads: int = 0
    num_failed_loads: int = 0
    checksum_failures: int = 0  # loads whose bytes did not match the producer's checksums
    leases_expired: int = 0
    acks_received: int = 0
    acks_ignored: int = 0
    acks_refused: int = 0  # naming another incarnation (epoch) of this instance
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
    checksum_failures: int = 0  # failed loads whose bytes did not match their checksums
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
    checksum_failures: int = 0  # fallbacks whose outputs did not match their checksums


@dataclass(frozen=True)
class KVConnectorStats:
    """What a KV connector reports, each field under its key in `EngineCore.stats()`: the part
    of each kind of connector it is or combines (None without one) and, where it keeps them,
    its own counts of KV sends awaiting an ack and loads in flight (they replace the
    scheduler's)."""

    kv_transfer: KVTransferStats | None = None  # the P->D connector's
    kv_pool: KVPoolUse | None = None  # the cluster KV pool connector's
    num_pending_sends: int | None = None
    num_pending_recvs: int | None = None

    def reported(self) -> dict[str, object]:
        """The fields this connector reports (not None), by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def combined(cls, parts: Iterable[KVConnectorStats]) -> KVConnectorStats:
        """Each field from the first of `parts` that reports it (a combination holds one
        connector of each kind)."""
        return cls(**ChainMap(*(part.reported() for part in parts)))

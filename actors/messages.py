"""Typed messages between gateway replicas and instances (the data and control plane).

A gateway replica submits a request to an instance with a `Route` (who reads its outputs,
where its encoder outputs come from, which D takes over after prefill) and reads every one
of its requests on that instance with one `pull` per step, answered by a `PullReply`
carrying the outputs, the instance's load, its prefix-cache changes and the stage times of
the requests that left it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pdcluster.connectors.stats import ECStats, KVPoolUse, KVTransferStats
from pdcluster.engine.lora.manager import LoRAStats
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.spec_decode.metrics import SpecDecodingStats
from pdcluster.routing.role import Role


@dataclass(frozen=True)
class Route:
    consumer_id: str  # the gateway replica that pulls the request's outputs
    ec_handle: list[Any] | None = None  # refs of E's encode call, for P (or a colocated D)
    decode_id: str | None = None  # P: the D that continues the request after its first token


@dataclass(frozen=True)
class LoadReport:
    """An instance's load as it counts it, for every replica's requests."""

    num_active: int  # unfinished requests
    queued_prefill_tokens: int  # prompt tokens not yet computed
    kv_tokens: int  # KV tokens the unfinished requests hold or may still need
    num_blocks_free: int
    num_blocks_total: int
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters resident in its layers


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's queues, block pool and token counters (an encoder: its queue only)."""

    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_deferred: int = 0  # waiting on encoder outputs or remote KV
    num_pending_sends: int = 0  # KV sends awaiting an ack (the KV connector's count)
    num_pending_recvs: int = 0  # KV loads in flight (the KV connector's count)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_encoder_cache_refs: int = 0
    num_unfinished: int = 0
    prefill_tokens_queued: int = 0  # prompt tokens not yet computed
    kv_tokens_reserved: int = 0  # KV tokens unfinished requests hold or may still need

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 without blocks)."""
        total = self.num_blocks_total
        return 1.0 - self.num_blocks_free / total if total else 0.0


@dataclass(frozen=True)
class SimStats:
    """A simulated engine's step counters (`model: sim:PROFILE`)."""

    steps: int = 0
    steps_overrun: int = 0  # steps that took longer than modeled
    overrun_s: float = 0.0
    modeled_busy_s: float = 0.0
    time_scale: float = 1.0


@dataclass(frozen=True)
class TensorParallelStats:
    size: int = 1
    worker_pids: tuple[int, ...] = ()  # rank 1 first
    worker_actor_ids: tuple[str, ...] = ()  # Ray workers' actor ids (hex)


@dataclass(frozen=True)
class InstanceStats:
    """One instance's snapshot (`InstanceActor.stats()`), as the gateway's views, metrics,
    the planner and `Cluster.stats()` read it. `healthy` and `reachable` are its reader's
    view: an instance that did not answer is `InstanceStats.unreachable(...)`, all zeros."""

    instance_id: str
    role: Role
    healthy: bool = True
    reachable: bool = True
    pid: int | None = None
    node_id: str | None = None
    epoch: str = ""  # this incarnation: a restart under the same name gets a new one
    num_threads: int = 0
    paused: bool = False
    num_steps: int = 0
    num_active: int = 0  # requests the engine holds (finished ones awaiting a free included)
    num_stage_clocks: int = 0  # requests whose stage times are still open
    num_streams: int = 0  # open output streams and encode calls
    num_pulls: int = 0  # pulls answered, for every consumer
    kv_cache_bytes: int = 0
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    kv_transfer: KVTransferStats = field(default_factory=KVTransferStats)
    kv_pool: KVPoolUse = field(default_factory=KVPoolUse)
    ec: ECStats = field(default_factory=ECStats)
    tensor_parallel: TensorParallelStats = field(default_factory=TensorParallelStats)
    sim: SimStats | None = None  # a simulated engine's
    spec_decode: SpecDecodingStats | None = None  # an engine that speculates: its drafts
    lora: LoRAStats | None = None  # an engine that serves LoRA adapters: theirs

    @classmethod
    def unreachable(cls, instance_id: str, role: Role) -> InstanceStats:
        return cls(instance_id, role, healthy=False, reachable=False)

    @property
    def num_pending_transfers(self) -> int:
        """KV sends awaiting an ack plus KV loads in flight."""
        return self.scheduler.num_pending_sends + self.scheduler.num_pending_recvs

    def is_idle(self) -> bool:
        """Holds nothing: every block free, no request, stream or transfer."""
        s = self.scheduler
        return s.num_blocks_free == s.num_blocks_total and not (
            s.num_running or s.num_waiting or s.num_deferred or s.num_pending_sends
            or s.num_pending_recvs or s.num_encoder_cache_refs or self.kv_pool.pending_loads
            or self.num_streams or self.num_stage_clocks
        )  # fmt: skip

    @classmethod
    def from_engine(cls, engine: Mapping[str, Any], **instance: Any) -> InstanceStats:
        """The snapshot of an instance (`instance`: its own fields) whose engine reported
        `engine` (`EngineCore.stats()` / `EncoderCore.stats()`: plain counters, and the
        typed parts under the names of their fields here)."""
        parts = {name: engine[name] for name in _TYPED_PARTS if name in engine}
        tensor_parallel = TensorParallelStats(
            size=engine.get("tensor_parallel_size", 1),
            worker_pids=tuple(engine.get("tp_worker_pids", ())),
            worker_actor_ids=tuple(engine.get("tp_worker_actor_ids", ())),
        )
        return cls(
            **instance,
            kv_cache_bytes=engine.get("kv_cache_bytes", 0),
            scheduler=_part(SchedulerStats, engine),
            tensor_parallel=tensor_parallel,
            sim=_part(SimStats, engine, "sim_") if "sim_steps" in engine else None,
            **parts,
        )


# Fields an engine reports typed, under their own names (the connectors' parts, the drafts'
# counters, its adapters); one it does not report keeps its default (zero, or None).
_TYPED_PARTS = ("kv_transfer", "kv_pool", "ec", "spec_decode", "lora")


_Part = TypeVar("_Part")


def _part(cls: type[_Part], flat: Mapping[str, Any], prefix: str = "") -> _Part:
    """`cls` from the keys of `flat` that name its fields (after `prefix`); the engine's
    parts report only what they have (an encoder has no blocks, a model no sim counters),
    the rest keeps its default."""
    names = (f.name for f in fields(cls))  # type: ignore[arg-type]
    return cls(**{n: flat[prefix + n] for n in names if prefix + n in flat})


@dataclass(frozen=True)
class KVEvents:
    """Prefix-cache changes after the consumer's cursor; `reset`: `stored` is the whole
    cache (the consumer was new, fell behind the log, or the instance restarted)."""

    epoch: str  # one per actor incarnation: a cursor from another epoch is meaningless
    cursor: int  # pass back as `events_after` in the next pull
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False


@dataclass(frozen=True)
class StageTimes:
    """When one request passed each stage on one instance (wall clock, time.time(), so that
    the instances and replicas of one node compare; step granularity). Sent once, with the
    request's last output from that instance (P: its first token, handed to D)."""

    request_id: str
    instance_id: str
    role: Role
    received_s: float  # `submit` reached the instance
    scheduled_s: float | None = None  # start of the first step that ran it (D: KV landed)
    first_token_s: float | None = None  # end of the step that produced its first token here
    finished_s: float | None = None  # its last output here left the step loop


@dataclass(frozen=True)
class PullReply:
    outputs: list[EngineCoreOutput]
    load: LoadReport
    events: KVEvents
    accepting: bool  # False while draining or stopping: route nothing new here
    stage_times: list[StageTimes] = field(default_factory=list)  # of requests that left here


@dataclass(frozen=True)
class RequestTrace:
    """What one gateway replica saw of a finished request, with the stage times of every
    instance it passed (`Front.traces()`; wall clock like `StageTimes`)."""

    request_id: str  # the caller's
    prompt_head: tuple[int, ...]  # its first prompt token ids: tells a caller's requests apart
    num_prompt_tokens: int
    num_output_tokens: int
    started_s: float  # the replica planned it
    first_token_s: float | None  # its first token reached the replica
    finished_s: float
    stage_times: list[StageTimes]  # in the order the instances let the request go
    num_moves: int = 0  # times it moved off a lost instance (see actors/front/flights.py)

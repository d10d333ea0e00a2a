"""Typed messages between gateway replicas and instances (the data and control plane).

A gateway replica submits a request to an instance with a `Route` (who reads its outputs,
where its encoder outputs come from, which D takes over after prefill) and reads every one
of its requests on that instance with one `pull` per step, answered by a `PullReply`
carrying the outputs, the instance's load, its prefix-cache changes and the stage times of
the requests that left it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.engine.outputs import EngineCoreOutput


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
    role: str
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
    num_moves: int = 0  # times it moved off a lost instance (see actors/front.py)

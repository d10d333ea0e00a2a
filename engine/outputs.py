"""Typed messages between scheduler, runner, connectors and the engine's clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.request import MultiModalFeature
from pdcluster.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TopLogprobs:
    """The likeliest tokens at one output position, best first, with their log-probabilities
    (of the model's raw distribution, like every logprob here)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens, index-aligned from the second prompt token on (the
    first has none): each token's logprob, its rank at its position (1: the likeliest), and
    the `prompt_logprobs` likeliest there (empty tuples when none were asked)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)

    def extend(self, other: PromptLogprobs) -> None:
        """Append the positions that follow (a later prefill chunk's)."""
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top += other.top


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after its state was dropped)."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prior_output_tokens: int = 0  # see Request.num_prior_output_tokens
    # Speculative method draft_model: positions [0, this) hold the draft model's KV, loaded
    # with the target's from a producer that drafts (engine.spec_decode.draft_model).
    num_draft_computed_tokens: int = 0
    # Its prompt's KV goes to a consumer (do_remote_decode): a draft model computes its own
    # KV for the prompt beside the target's, and it travels with the target's.
    sends_kv: bool = False
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds, index-aligned lists."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Blocks appended this step; the whole block table when resumed from preemption.
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Blocks dropped from the end of the table since the request last ran (the slots of
    # rejected draft tokens), before new_block_ids are appended; 0 when resumed.
    num_trimmed_blocks: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # req_id -> indices into the request's mm_features whose encoder runs this step.
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    free_encoder_mm_hashes: list[str]  # encoder outputs the runner may drop
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens verified this step, after the request's last token; a request
    # here has 1 + len(drafts) scheduled tokens and samples at every one of them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_metadata: Any = None
    ec_connector_metadata: Any = None

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, {}, set(), [])


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)  # producer: acked or lease expired
    finished_recving: set[str] = field(default_factory=set)  # consumer: KV landed in our blocks
    failed_recving: set[str] = field(default_factory=set)  # consumer: load failed


@dataclass
class RunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    # One list per request: the sampled token (with drafts: the accepted ones and the
    # token after them), or empty for a partial (chunked) prefill.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None  # index-aligned with sampled_token_ids
    grammar_done_req_ids: set[str] = field(default_factory=set)  # grammar complete: stop
    # Index-aligned too; a request that asked for no alternatives has an empty list.
    top_logprobs: list[list[TopLogprobs]] | None = None
    # req_id -> the prompt positions this step computed, for requests asking prompt_logprobs.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
    """What a client sees of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[TopLogprobs] | None = None  # with logprobs > 0: one per new token
    # With prompt_logprobs: every prompt token's, on the request's first output with tokens.
    prompt_logprobs: PromptLogprobs | None = None
    new_text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None  # a prefill's handoff to its D
    num_cached_tokens: int = 0
    # Seconds the request waited on this instance before it was first scheduled; set on
    # the first output with tokens from each instance that queued it.
    queue_time_s: float | None = None
    # With finish_reason "error": the cluster could not serve the request (an instance was
    # lost, or none was live); the same request may succeed later.
    unavailable: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def coalesce(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One output per request for outputs that arrived together (a consumer behind its
    producer, as vLLM's output collector merges them): each request's outputs in order, as
    one that carries all their tokens, texts and logprobs, and the last one's end. The
    requests keep the order of their first outputs. Outputs are not changed."""
    if len(outputs) < 2:
        return outputs
    runs: dict[str, list[EngineCoreOutput]] = {}
    for out in outputs:
        runs.setdefault(out.request_id, []).append(out)
    if len(runs) == len(outputs):
        return outputs
    return [run[0] if len(run) == 1 else _joined(run) for run in runs.values()]


def _joined(run: list[EngineCoreOutput]) -> EngineCoreOutput:
    first, last = run[0], run[-1]
    token_ids = [t for out in run for t in out.new_token_ids]
    logprobs = None
    if first.new_logprobs is not None:
        logprobs = [lp for out in run for lp in out.new_logprobs or ()]
    top = None
    if first.new_top_logprobs is not None:
        top = [t for out in run for t in out.new_top_logprobs or ()]
    return EngineCoreOutput(
        first.request_id,
        token_ids,
        new_logprobs=logprobs,
        new_top_logprobs=top,
        prompt_logprobs=next(
            (o.prompt_logprobs for o in run if o.prompt_logprobs is not None), None
        ),
        new_text="".join(out.new_text for out in run),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        error=last.error,
        kv_transfer_params=last.kv_transfer_params,
        num_cached_tokens=max(out.num_cached_tokens for out in run),
        queue_time_s=next((o.queue_time_s for o in run if o.queue_time_s is not None), None),
        unavailable=last.unavailable,
    )

"""Helpers of the scheduler: one step's running state, what trying a waiting request finds
and comes to, encoder admission, stop checks, and the checks and load figures of its requests.

Kept apart from `engine.scheduler` so that each module reads in one sitting; only the
scheduler calls these.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdcluster.connectors.base import ECConnectorBase
from pdcluster.engine.block_pool import KVCacheBlock
from pdcluster.engine.config import SchedulerConfig
from pdcluster.engine.encoder_cache_manager import EncoderCacheManager
from pdcluster.engine.outputs import CachedRequestData, NewRequestData, PromptLogprobs
from pdcluster.engine.request import Request, RequestStatus


class Outcome(enum.Enum):
    """What became of one waiting request the scheduler tried this step."""

    SCHEDULED = enum.auto()  # admitted: it runs this step
    SKIP = enum.auto()  # passed over (deferred, or parked for its remote KV): the next is tried
    STOP = enum.auto()  # its blocks do not fit: no later request is tried this step


@dataclass
class Lookup:
    """What a waiting request finds before it is scheduled."""

    computed_blocks: list[KVCacheBlock]  # prefix-cache hits
    num_computed: int  # tokens computed with them (or before, by a landed load)
    num_external: int = 0  # tokens the KV connector adds
    load_async: bool = False  # whether it loads them while other requests step

    @property
    def parks(self) -> bool:
        """Whether the request waits for an asynchronous load before it runs."""
        return self.load_async and self.num_external > 0


@dataclass
class EncoderPlan:
    """A request's encoder inputs for its next chunk of `num_new` tokens: the features
    (indices into its mm_features) to encode here, and those to load from the EC connector."""

    num_new: int
    to_compute: list[int] = field(default_factory=list)
    to_load: list[int] = field(default_factory=list)


class StepState:
    """What one schedule() call has decided so far."""

    __slots__ = (
        "token_budget",
        "encoder_budget",
        "total_num_scheduled_tokens",
        "num_scheduled_tokens",
        "new_reqs",
        "cached_reqs",
        "encoder_inputs",
        "preempted_req_ids",
        "step_skipped",
    )

    def __init__(self, token_budget: int, encoder_budget: int) -> None:
        self.token_budget = token_budget
        self.encoder_budget = encoder_budget
        self.total_num_scheduled_tokens = 0
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.encoder_inputs: dict[str, list[int]] = {}
        self.preempted_req_ids: set[str] = set()
        self.step_skipped: list[Request] = []  # passed over this step, order kept

    def record(self, request: Request, num_new: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new
        self.total_num_scheduled_tokens += num_new
        self.token_budget -= num_new
        request.num_computed_tokens += num_new


def check_stop(
    request: Request, token_id: int, max_model_len: int, grammar_done: bool = False
) -> RequestStatus | None:
    """The finished status `token_id` (just appended) puts the request in, if any. Stop
    strings are not checked here: the engine core's detokenizer calls finish_requests.
    A complete grammar (`grammar_done`) stops the request: it allows no further token."""
    params = request.sampling_params
    if grammar_done:
        return RequestStatus.FINISHED_STOPPED
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output + len(request.prompt_token_ids) >= max_model_len or (
        params.max_tokens is not None and num_output >= params.max_tokens
    ):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def plan_encoder_inputs(
    request: Request,
    num_computed: int,
    num_new: int,
    st: StepState,
    cache: EncoderCacheManager,
    ec_connector: ECConnectorBase | None,
) -> EncoderPlan:
    """Features overlapping [num_computed, num_computed + num_new) that are not cached yet
    (cached ones are referenced now). A feature the EC connector holds is loaded: cache space
    but no compute budget. Where one does not fit, num_new is cut to end before its
    placeholder run, so no run is scheduled without its encoder output."""
    to_compute: list[int] = []
    to_load: list[int] = []
    planned: set[str] = set()
    budget = st.encoder_budget
    num_embeds = 0
    end = num_computed + num_new
    for i, f in enumerate(request.mm_features):
        if f.offset >= end:
            break
        if f.end <= num_computed or f.mm_hash in planned:
            continue
        if cache.check_and_update_cache(request, i):
            continue
        is_remote = ec_connector is not None and ec_connector.has_cache_item(f.mm_hash)
        if not cache.can_allocate(request, i, float("inf") if is_remote else budget, num_embeds):
            num_new = max(0, f.offset - num_computed)
            break
        (to_load if is_remote else to_compute).append(i)
        planned.add(f.mm_hash)
        num_embeds += f.length
        if not is_remote:
            budget -= f.length
    return EncoderPlan(num_new, to_compute, to_load)


def commit_encoder_inputs(
    request: Request,
    plan: EncoderPlan,
    st: StepState,
    cache: EncoderCacheManager,
    ec_connector: ECConnectorBase | None,
) -> None:
    """Take cache space for a planned request that was scheduled."""
    for i in plan.to_compute:
        cache.allocate(request, i)
        st.encoder_budget -= request.mm_features[i].length
    if plan.to_compute:
        st.encoder_inputs[request.request_id] = plan.to_compute
    for i in plan.to_load:
        cache.allocate(request, i)
        ec_connector.update_state_after_alloc(request, i)


def free_consumed_encoder_inputs(request: Request, cache: EncoderCacheManager) -> None:
    """Release encoder outputs whose placeholder runs (every run of that image) are computed."""
    n = request.num_computed_tokens
    pending = {f.mm_hash for f in request.mm_features if f.end > n}
    for i in cache.get_cached_input_ids(request):
        if request.mm_features[i].mm_hash not in pending:
            cache.free_encoder_input(request, i)


def needs_prompt_logits_here(request: Request) -> bool:
    """Whether the request's prompt must be computed here at every position (for its prompt
    logprobs), rather than read from the prefix cache or a KV connector."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids


def add_prompt_logprobs(request: Request, chunk: PromptLogprobs | None) -> None:
    """Keep a prefill chunk's prompt logprobs until the request's first output."""
    if chunk is None:
        return
    if request.prompt_logprobs is None:
        request.prompt_logprobs = PromptLogprobs()
    request.prompt_logprobs.extend(chunk)


def take_prompt_logprobs(request: Request) -> PromptLogprobs | None:
    """For the request's first output: its prompt logprobs, when it asked for them (a
    one-token prompt has none)."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    found, request.prompt_logprobs = request.prompt_logprobs, None
    return found or PromptLogprobs()


def check_mm_fits(request: Request, config: SchedulerConfig, has_ec_connector: bool) -> None:
    """ValueError when one of the request's images can never be admitted: it expands to more
    embeddings than the encoder cache holds (or, encoding locally, than one step computes)."""
    limit = config.encoder_cache_size
    if not has_ec_connector:
        limit = min(limit, config.encoder_compute_budget)
    for f in request.mm_features:
        if f.length > limit:
            raise ValueError(
                f"image {f.mm_hash!r} expands to {f.length} embeddings, more than the "
                f"encoder cache size / compute budget ({limit})"
            )


def load_figures(requests: Iterable[Request], max_model_len: int) -> dict[str, int]:
    """What routers balance on: prompt tokens still to prefill, and the KV tokens the
    unfinished requests hold or will hold (prompt + the most they may generate)."""
    queued = reserved = num_unfinished = 0
    for r in requests:
        if r.is_finished():
            continue
        num_unfinished += 1
        queued += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        asked = r.sampling_params.max_tokens
        room = max_model_len - r.num_prompt_tokens
        reserved += r.num_prompt_tokens + (room if asked is None else min(asked, room))
    return {
        "num_unfinished": num_unfinished,
        "prefill_tokens_queued": queued,
        "kv_tokens_reserved": reserved,
    }

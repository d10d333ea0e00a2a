"""Helpers of the scheduler: one step's running state, what trying a waiting request finds
and comes to, encoder admission, and the checks and load figures of its requests.

Kept apart from `engine.scheduler` so that each module reads in one sitting; only the
scheduler calls these.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.connectors.base import ECConnectorBase
from pdcluster.engine.block_pool import KVCacheBlock
from pdcluster.engine.config import SchedulerConfig
from pdcluster.engine.encoder_cache_manager import EncoderCacheManager
from pdcluster.engine.outputs import CachedRequestData, NewRequestData
from pdcluster.engine.request import Request

if TYPE_CHECKING:
    from pdcluster.engine.kv_cache_manager import KVCacheManager
    from pdcluster.engine.remote_kv import RemoteKV


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
        "spec_decode_tokens",
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
        self.spec_decode_tokens: dict[str, list[int]] = {}
        self.step_skipped: list[Request] = []  # passed over this step, order kept

    def add_cached(
        self,
        req_id: str,
        resumed: bool,
        new_block_ids: list[int] | None,
        num_computed: int,
        num_trimmed_blocks: int = 0,
    ) -> None:
        """A request the runner holds, scheduled again (see CachedRequestData)."""
        cached = self.cached_reqs
        cached.req_ids.append(req_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(num_computed)
        cached.num_trimmed_blocks.append(num_trimmed_blocks)

    def record(self, request: Request, num_new: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new
        self.total_num_scheduled_tokens += num_new
        self.token_budget -= num_new
        request.num_computed_tokens += num_new


def lookup(
    request: Request,
    kv: KVCacheManager,
    remote_kv: RemoteKV | None,
    ec: ECConnectorBase | None,
) -> Lookup | None:
    """What a waiting request finds in the prefix cache and the KV connector. None when
    it must wait: the KV connector does not know yet, or the EC connector defers it."""
    found = Lookup([], request.num_computed_tokens)
    needs_prompt_logits = needs_prompt_logits_here(request)
    if request.request_id not in kv.req_to_blocks and not needs_prompt_logits:
        found.computed_blocks, found.num_computed = kv.get_computed_blocks(request)
    if remote_kv is not None and not needs_prompt_logits:
        num_external, found.load_async = remote_kv.match(request, found.num_computed)
        if num_external is None:
            return None
        if not found.load_async:  # loaded during the step: the last token is computed here
            num_external = min(num_external, request.num_tokens - 1 - found.num_computed)
        found.num_external = num_external
    if (
        ec is not None
        and request.mm_features
        and not ec.ensure_cache_available(request, found.num_computed + found.num_external)
    ):
        return None
    return found


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

"""The scheduler's part of speculative decoding: which running requests get draft tokens
this step, and what a verified step gives back.

A decode request with K drafts is scheduled for 1 + K tokens (its last token and the
drafts), with KV slots for all of them. After verification its `num_computed_tokens` drops
by the rejected drafts (their KV is garbage), the blocks past its computed tokens return to
the pool, and the runner is told to drop them from its block table. With a draft model the
drafts are slots here, which the runner's drafter fills (engine.spec_decode.draft_model).

Every sampling field is honoured per verified position (engine.spec_decode.verify), so any
decode request may get drafts: temperature, top-k/p, penalties, bad words, logit bias, seeds,
logprobs, stop tokens and strings, n, and structured outputs (each position's grammar mask
follows the drafts before it).
"""

from __future__ import annotations

from pdcluster.engine.config import SpeculativeConfig
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.request import Request
from pdcluster.engine.spec_decode.draft_model import DraftModelProposer
from pdcluster.engine.spec_decode.metrics import SpecDecodingStats
from pdcluster.engine.spec_decode.ngram_proposer import NgramProposer


class Speculation:
    def __init__(
        self, config: SpeculativeConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.proposer = (
            NgramProposer(config) if config.method == "ngram" else DraftModelProposer(config)
        )
        self.stats = SpecDecodingStats.new(config.num_speculative_tokens)
        # req_id -> blocks dropped from its table since it last ran, for the runner
        self._num_trimmed_blocks: dict[str, int] = {}

    def draft_tokens(self, request: Request, num_running: int, max_num_tokens: int) -> list[int]:
        """Drafts to verify with a decode request's next step (at most `max_num_tokens`, and
        never more than the request may still emit after the step's own token)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return []
        room = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        num_tokens = min(max_num_tokens, room - 1)
        if num_tokens < 1:
            return []
        return self.proposer.propose(request.all_token_ids, num_tokens)

    def verified(self, request: Request, num_draft_tokens: int, num_sampled: int) -> None:
        """A step verified `num_draft_tokens` drafts and sampled `num_sampled` tokens (the
        accepted drafts and one more): the rejected drafts' KV no longer counts."""
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= num_draft_tokens - num_accepted
        self.stats.observe_draft(num_draft_tokens, num_accepted)

    def give_back_slots(self, request: Request) -> None:
        """After the verified tokens were appended (the request still runs): publish the
        blocks its accepted tokens filled and free those past its computed tokens."""
        kv = self.kv_cache_manager
        kv.cache_blocks(request, request.num_computed_tokens)
        num_trimmed = kv.trim(request, request.num_computed_tokens)
        if num_trimmed:
            rid = request.request_id
            self._num_trimmed_blocks[rid] = self._num_trimmed_blocks.get(rid, 0) + num_trimmed

    def take_num_trimmed_blocks(self, req_id: str) -> int:
        """Blocks the runner must drop from the end of the request's table (it runs now, or
        its whole table is resent after a preemption)."""
        return self._num_trimmed_blocks.pop(req_id, 0)

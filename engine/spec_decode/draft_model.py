"""Drafts from a second, faster model (`method: draft_model`), e.g. the target in int4
drafting for itself in float32.

The scheduler gives a decode request K draft slots filled with `DRAFT_PLACEHOLDER`; the
runner's `Drafter` fills them at the start of that step, before the target verifies them.
The draft model's KV cache is a tensor of its own indexed by the target's block tables: a
position's draft KV sits in the same block and slot as its target KV, so the scheduler's
allocation covers both, a trimmed or freed block drops both, and a handoff that brings the
target's KV brings block ids the drafter fills itself.

Per request the runner's state counts the positions holding valid draft KV
(`num_draft_computed`). A step feeds the draft model every known token after them in one
pass (the whole prompt on a request's first decode step, e.g. after a P→D handoff or a
preemption; usually one or two tokens), then each draft it proposed, one pass per draft:
K passes, all requests batched, greedy. After verification the valid positions are those
the target keeps: an accepted draft is a token the draft model was fed.

Drafts never change what a request emits (the target samples every position and a draft
counts only where it equals that sample), so the drafter ignores sampling parameters, and
it reads a prompt's image placeholders as the tokens they are (a multimodal draft model, the
target itself included, drafts from text alone: a D has no image features after a handoff).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdcluster.engine.attention import AttentionMetadata, allocate_kv_cache
from pdcluster.engine.config import CacheConfig, Quantization, SpeculativeConfig
from pdcluster.engine.model_runner import CachedRequestState, prepare_model
from pdcluster.engine.models.loader import ModelInfo, load_model
from pdcluster.engine.precision import Precision
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.tokenizer import Tokenizer

DRAFT_PLACEHOLDER = -1  # a draft slot the runner's drafter fills


class DraftModelProposer:
    """The scheduler's side: `num_speculative_tokens` slots per step, filled by the runner."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: object, max_num_tokens: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * min(self.num_speculative_tokens, max_num_tokens)


def load_draft_model(
    config: SpeculativeConfig,
    target: Tokenizer,
    dtype: str,
    target_quantization: Quantization,
    device: torch.device,
) -> tuple[torch.nn.Module, ModelInfo, Precision]:
    """The draft model of `config` (in its quantization, else the target's) with its info
    and precision; ValueError when it does not share the target's vocabulary."""
    if config.model is None:
        raise ValueError("speculative_config: method 'draft_model' needs 'model'")
    path = resolve_model_dir(config.model)
    if not Tokenizer(path).has_vocabulary_of(target):
        raise ValueError(
            f"speculative_config: the draft model {config.model!r} has another vocabulary "
            "than the target; a draft model must share the target's tokenizer"
        )
    precision = Precision.resolve(dtype, config.quantization or target_quantization, device)
    model, info = load_model(path, device, precision.dtype)
    return model, info, precision


class Drafter:
    """Runs the draft model for the runner; its KV cache follows the target's blocks."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        precision: Precision,
        cache: CacheConfig,  # the target's, its block count fixed
        vocab_size: int,  # the target's: draft ids at or above it are never proposed
        device: torch.device,
    ) -> None:
        if cache.num_blocks is None:
            raise ValueError("the drafter's cache follows a sized target cache")
        prepare_model(model, precision, device)
        self.model = model
        self.kv_cache = allocate_kv_cache(
            cache.num_blocks, cache.block_size, info, precision.dtype, device
        )
        self.block_size = cache.block_size
        self.vocab_size = vocab_size
        self.device = device

    @torch.inference_mode()
    def propose(
        self,
        requests: Mapping[str, CachedRequestState],
        slots: Mapping[str, list[int]],  # req_id -> its draft slots this step
    ) -> dict[str, list[int]]:
        """Greedy drafts for each request's slots (as many as it has)."""
        rows = [(requests[r], len(s)) for r, s in slots.items()]
        drafts: list[list[int]] = [[] for _ in rows]
        # Pass 0: every known token past the valid draft KV; pass j: the j-th draft.
        for j in range(max(k for _, k in rows)):
            live = [i for i, (_, k) in enumerate(rows) if k > j]
            if j == 0:
                starts = [min(s.num_draft_computed, s.num_computed_tokens) for s, _ in rows]
                inputs = [rows[i][0].token_ids[starts[i] :] for i in live]
            else:
                starts = [len(s.token_ids) - 1 + j for s, _ in rows]
                inputs = [drafts[i][-1:] for i in live]
            next_ids = self._forward(
                [starts[i] for i in live], inputs, [rows[i][0].block_ids for i in live]
            )
            for i, token_id in zip(live, next_ids):
                drafts[i].append(token_id)
        for s, k in rows:  # positions up to the last draft fed hold valid draft KV
            s.num_draft_computed = len(s.token_ids) + k - 1
        return {r: d for r, d in zip(slots, drafts)}

    def _forward(
        self, starts: list[int], inputs: list[list[int]], tables: list[list[int]]
    ) -> list[int]:
        """One pass of the draft model: each row's `inputs` at positions from its `start`;
        the argmax of each row's last position."""
        meta = AttentionMetadata.build(
            starts, [len(t) for t in inputs], tables, self.block_size, self.device
        )
        flat = [t for row in inputs for t in row]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        embeds = self.model.embed_tokens(ids)  # [T, hidden]
        hidden = self.model.forward(embeds, meta.positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[meta.logits_indices])[:, : self.vocab_size]
        return logits.argmax(dim=-1).tolist()

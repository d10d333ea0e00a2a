"""Drafts from a second, faster model (`method: draft_model`), e.g. the target in int4
drafting for itself in float32.

The scheduler gives a decode request K draft slots filled with `DRAFT_PLACEHOLDER`; the
runner's `Drafter` fills them at the start of that step, before the target verifies them.
The draft model's KV cache is a tensor of its own indexed by the target's block tables: a
position's draft KV sits in the same block and slot as its target KV, so the scheduler's
allocation covers both, a trimmed or freed block drops both, and a handoff that brings the
target's KV brings block ids the drafter fills itself.

Per request the runner's state counts the positions holding valid draft KV
(`num_draft_computed`). A step first feeds the draft model, in one pass, the known tokens
after them but the last (the prompt on a request's first decode step, e.g. after a P→D
handoff or a preemption; after a step that accepted every draft, the last draft), then the
last token and each draft it proposes, one decode pass each: K passes, all requests
batched, greedy. After verification the valid positions are those the target keeps: an
accepted draft is a token the draft model was fed.

Drafts never change what a request emits (the target samples every position and a draft
counts only where it equals that sample), so the drafter ignores sampling parameters, and
it reads a prompt's image placeholders as the tokens they are (a multimodal draft model, the
target itself included, drafts from text alone: a D has no image features after a handoff).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

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

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        """As `NgramProposer.propose`, the drafts left to the runner."""
        return [DRAFT_PLACEHOLDER] * min(self.num_speculative_tokens, max_num_tokens)


def draft_model_dir(config: SpeculativeConfig, target: Tokenizer) -> str:
    """The draft model's checkpoint folder; ValueError when it does not share the target's
    vocabulary (FileNotFoundError when there is none)."""
    if config.model is None:
        raise ValueError("speculative_config: method 'draft_model' needs 'model'")
    try:
        path = resolve_model_dir(config.model)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"speculative_config: the draft model: {exc}") from None
    if not Tokenizer(path).has_vocabulary_of(target):
        raise ValueError(
            f"speculative_config: the draft model {config.model!r} has another vocabulary "
            "than the target; a draft model must share the target's tokenizer"
        )
    return path


class DraftModel(NamedTuple):
    model: torch.nn.Module  # as loaded, not yet prepared for its precision
    info: ModelInfo
    precision: Precision


def load_draft_model(
    config: SpeculativeConfig,
    target: Tokenizer,
    dtype: str,
    target_quantization: Quantization,
    device: torch.device,
) -> DraftModel:
    """The draft model of `config`, in its quantization, else the target's."""
    path = draft_model_dir(config, target)
    precision = Precision.resolve(dtype, config.quantization or target_quantization, device)
    model, info = load_model(path, device, precision.dtype)
    return DraftModel(model, info, precision)


class Drafter:
    """Runs the draft model for the runner; its KV cache follows the target's blocks."""

    def __init__(
        self,
        draft: DraftModel,
        cache: CacheConfig,  # the target's, its block count fixed
        vocab_size: int,  # the target's: draft ids at or above it are never proposed
        device: torch.device,
    ) -> None:
        if cache.num_blocks is None:
            raise ValueError("the drafter's cache follows a sized target cache")
        prepare_model(draft.model, draft.precision, device)
        self.model = draft.model
        self.kv_cache = allocate_kv_cache(
            cache.num_blocks, cache.block_size, draft.info, draft.precision.dtype, device
        )
        self.block_size = cache.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.num_catch_up_tokens = 0  # fed before drafting: see SpecDecodingStats

    def follow(self, chunks: Sequence[tuple[CachedRequestState, int]]) -> None:
        """Feed each request's known tokens up to its `end` (the target computes them this
        step): its draft KV is then valid as far as the target's."""
        self._catch_up(chunks)

    @torch.inference_mode()
    def propose(
        self,
        requests: Mapping[str, CachedRequestState],
        slots: Mapping[str, list[int]],  # req_id -> its draft slots this step
    ) -> dict[str, list[int]]:
        """Greedy drafts for each request's slots (as many as it has)."""
        states = [requests[r] for r in slots]
        # Catch up to each request's last token first (its logits unused), so that each
        # pass after it is a decode pass: one token per request, the engine's fastest.
        self.num_catch_up_tokens += self._catch_up([(s, len(s.token_ids) - 1) for s in states])
        drafts: list[list[int]] = [[s.token_ids[-1]] for s in states]  # then the drafts
        for j in range(max(len(k) for k in slots.values())):
            live = [i for i, k in enumerate(slots.values()) if len(k) > j]
            hidden = self._forward(
                [len(states[i].token_ids) - 1 + j for i in live],
                [drafts[i][-1:] for i in live],
                [states[i].block_ids for i in live],
            )
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
            for i, token_id in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[i].append(token_id)
        for s, d in zip(states, drafts):  # every position up to the last draft fed
            s.num_draft_computed = len(s.token_ids) + len(d) - 2
        return {r: d[1:] for r, d in zip(slots, drafts)}

    def _catch_up(self, ends: Sequence[tuple[CachedRequestState, int]]) -> int:
        """One pass feeding each request the tokens it lacks draft KV for, up to its end;
        returns how many tokens it fed."""
        behind = [(s, min(s.num_draft_computed, s.num_computed_tokens), end) for s, end in ends]
        behind = [(s, start, end) for s, start, end in behind if start < end]
        if behind:
            self._forward(
                [start for _, start, _ in behind],
                [s.token_ids[start:end] for s, start, end in behind],
                [s.block_ids for s, _, _ in behind],
            )
        for s, _, end in behind:
            s.num_draft_computed = end
        return sum(end - start for _, start, end in behind)

    def _forward(
        self, starts: list[int], inputs: list[list[int]], tables: list[list[int]]
    ) -> torch.Tensor:
        """One pass of the draft model, each row's `inputs` at positions from its `start`
        (its KV written); the hidden state of each row's last input, [rows, hidden]."""
        meta = AttentionMetadata.build(
            starts, [len(t) for t in inputs], tables, self.block_size, self.device
        )
        flat = [t for row in inputs for t in row]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        embeds = self.model.embed_tokens(ids)  # [T, hidden]
        hidden = self.model.forward(embeds, meta.positions, self.kv_cache, meta)
        return hidden[meta.logits_indices]

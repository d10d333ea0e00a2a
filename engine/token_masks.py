"""Tokens a row of a step's batch may not sample: those outside its `allowed_token_ids`, and
the last token of each of its bad words whose other tokens the output already ends with.

Built for the rows that ask only, as index tensors applied to the whole batch of logits at
once; a batch where no row asks builds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pdcluster.engine.sampling_params import SamplingParams


@dataclass
class TokenMasks:
    """`logits[rows[i], token_ids[i]]` set to -inf, for every (row, token) pair given; and
    for `allowed_rows`, every token not set in `allowed` [len(allowed_rows), vocab]."""

    rows: torch.Tensor | None = None  # [num_banned] long
    token_ids: torch.Tensor | None = None  # [num_banned] long
    allowed_rows: torch.Tensor | None = None  # [m] long
    allowed: torch.Tensor | None = None  # [m, vocab] bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> TokenMasks | None:
        """The masks of a batch whose row i samples under `params[i]` after generating
        `outputs[i]`; None when no row has allowed tokens or bad words."""
        banned = [
            (row, token_id)
            for row, (p, output) in enumerate(zip(params, outputs))
            for token_id in banned_by_bad_words(p.bad_words_token_ids, output)
        ]
        allowed_rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        if not banned and not allowed_rows:
            return None
        masks = cls()
        if banned:
            pairs = torch.tensor(banned, dtype=torch.long, device=device)  # [num_banned, 2]
            masks.rows, masks.token_ids = pairs[:, 0], pairs[:, 1]
        if allowed_rows:
            allowed = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool, device=device)
            for i, row in enumerate(allowed_rows):
                ids = [t for t in params[row].allowed_token_ids or [] if t < vocab_size]
                allowed[i, torch.tensor(ids, dtype=torch.long, device=device)] = True
            masks.allowed_rows = torch.tensor(allowed_rows, dtype=torch.long, device=device)
            masks.allowed = allowed
        return masks


def banned_by_bad_words(
    bad_words_token_ids: Sequence[Sequence[int]], output: Sequence[int]
) -> Iterator[int]:
    """The last token of each bad word whose earlier tokens end `output` (a one-token bad
    word is always banned)."""
    for ids in bad_words_token_ids:
        prefix = list(ids[:-1])
        start = len(output) - len(prefix)
        if not prefix or (start >= 0 and list(output[start:]) == prefix):
            yield ids[-1]


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set the masked tokens of `logits` [num_reqs, vocab] to -inf, in place."""
    if masks.allowed_rows is not None and masks.allowed is not None:
        rows = logits[masks.allowed_rows]  # [m, vocab]
        logits[masks.allowed_rows] = rows.masked_fill(~masks.allowed, float("-inf"))
    if masks.rows is not None and masks.token_ids is not None:
        logits[masks.rows, masks.token_ids] = float("-inf")

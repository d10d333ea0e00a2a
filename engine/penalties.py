"""Logit adjustments made before sampling: logit bias, token masks (`engine.token_masks`),
then penalties on tokens already seen.

Both work on a step's whole batch of logits [num_reqs, vocab] with tensor ops; rows that ask
for neither are not touched, and a batch where no row asks skips the work entirely. The
per-request token counts the penalties need live in `TokenCounts`, one row per request,
updated in place as tokens are sampled (never rebuilt from token lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.token_masks import TokenMasks, apply_token_masks


@dataclass
class LogitBias:
    """Additions to `logits[rows[i], token_ids[i]]`, one entry per (row, token) pair."""

    rows: torch.Tensor  # [num_entries] long
    token_ids: torch.Tensor  # [num_entries] long
    values: torch.Tensor  # [num_entries] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
        """The bias of `params[i]` on batch row i; None when no row has one."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row, p in enumerate(params):
            if not p.logit_bias:
                continue
            row_ids += [row] * len(p.logit_bias)
            token_ids += p.logit_bias.keys()
            values += p.logit_bias.values()
        if not row_ids:
            return None
        return cls(
            torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )


@dataclass
class Penalties:
    """Penalties of some rows of a batch, with the token counts they act on. A kind of
    penalty no row uses is None, and costs nothing."""

    rows: torch.Tensor  # [m] long: the batch rows with penalties
    output_counts: torch.Tensor  # [m, vocab] int32: times each token was generated
    # Repetition: [m, vocab] bool, tokens that occur in the prompt; [m, 1] float32.
    prompt_mask: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None  # [m, 1] float32, with frequency
    frequency: torch.Tensor | None = None  # [m, 1] float32


@dataclass
class LogitsAdjustments:
    """What to change in one step's logits before sampling (None: nothing of that kind)."""

    bias: LogitBias | None = None
    penalties: Penalties | None = None
    masks: TokenMasks | None = None  # allowed tokens and bad words


def adjust_logits(logits: torch.Tensor, adjustments: LogitsAdjustments) -> None:
    """Apply logit bias, token masks, then penalties, to `logits` [num_reqs, vocab] in place
    (a masked token stays at -inf through the penalties)."""
    if adjustments.bias is not None:
        apply_logit_bias(logits, adjustments.bias)
    if adjustments.masks is not None:
        apply_token_masks(logits, adjustments.masks)
    if adjustments.penalties is not None:
        apply_penalties(logits, adjustments.penalties)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    logits.index_put_((bias.rows, bias.token_ids), bias.values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """Repetition penalty on every token seen in prompt or output (positive logits divided,
    negative ones multiplied); then frequency (per occurrence) and presence (once) penalties
    subtracted for every generated token."""
    rows = logits[p.rows].float()  # [m, vocab]
    generated = p.output_counts > 0  # [m, vocab]
    if p.repetition is not None and p.prompt_mask is not None:
        seen = generated | p.prompt_mask
        repeated = torch.where(rows > 0, rows / p.repetition, rows * p.repetition)
        rows = torch.where(seen, repeated, rows)
    if p.frequency is not None and p.presence is not None:
        rows -= p.frequency * p.output_counts + p.presence * generated
    logits[p.rows] = rows.to(logits.dtype)


class TokenCounts:
    """Output-token counts and prompt-token masks of the requests whose sampling has
    penalties: one row each of two [capacity, vocab] tensors, reused once a request leaves."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def add(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Start tracking a request that has already generated `output_token_ids`."""
        row = self._take_row()
        self._row_of[req_id] = row
        self.output_counts[row] = torch.bincount(
            torch.tensor(output_token_ids, dtype=torch.long, device=self.device),
            minlength=self.vocab_size,
        )
        self.prompt_mask[row] = False
        self.prompt_mask[row, torch.tensor(prompt_token_ids, device=self.device)] = True

    def remove(self, req_id: str) -> None:
        row = self._row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def append(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Count the token each request just generated (untracked requests are skipped)."""
        if not self._row_of:
            return
        pairs = [(self._row_of[r], t) for r, t in zip(req_ids, token_ids) if r in self._row_of]
        _add_ones(self.output_counts, pairs)

    def penalties(
        self,
        req_ids: list[str],
        params: list[SamplingParams],
        drafted: Sequence[Sequence[int]] | None = None,
    ) -> Penalties | None:
        """Penalties of a batch whose row i holds request `req_ids[i]` with `params[i]`,
        for the tracked rows; None when none is tracked. `drafted[i]`: tokens row i counts
        as generated beyond those recorded (the draft tokens before a verified position).
        A request may hold several rows."""
        if not self._row_of:
            return None
        rows = [i for i, r in enumerate(req_ids) if r in self._row_of]
        if not rows:
            return None
        params = [params[i] for i in rows]
        index = torch.tensor([self._row_of[req_ids[i]] for i in rows], device=self.device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)

        penalties = Penalties(
            torch.tensor(rows, dtype=torch.long, device=self.device), self.output_counts[index]
        )
        if drafted is not None:
            pairs = [(k, t) for k, i in enumerate(rows) for t in drafted[i]]
            _add_ones(penalties.output_counts, pairs)
        if any(p.repetition_penalty != 1 for p in params):
            penalties.prompt_mask = self.prompt_mask[index]
            penalties.repetition = column([p.repetition_penalty for p in params])
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            penalties.presence = column([p.presence_penalty for p in params])
            penalties.frequency = column([p.frequency_penalty for p in params])
        return penalties

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.output_counts.shape[0]
            new = max(4, 2 * old)
            grow = (new - old, self.vocab_size)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(grow)])
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(grow)])
            self._free_rows = list(range(new - 1, old - 1, -1))
        return self._free_rows.pop()


def _add_ones(counts: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Add one to `counts[row, token_id]` (counts: [rows, vocab] int32) for each pair."""
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.long, device=counts.device)  # [n, 2]
    ones = torch.ones(len(pairs), dtype=counts.dtype, device=counts.device)
    counts.index_put_((index[:, 0], index[:, 1]), ones, accumulate=True)

"""Token sampling for one step's batch of logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.outputs import PromptLogprobs, TopLogprobs
from pdcluster.engine.penalties import LogitsAdjustments, adjust_logits
from pdcluster.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[TopLogprobs | None]  # per row: its `logprobs` likeliest, if it asked


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    adjustments: LogitsAdjustments | None = None,
    grammar_bitmask: torch.Tensor | None = None,
) -> SamplerOutput:
    """Pick one token per row.

    logits: [num_reqs, vocab] float32, changed in place by `adjustments` (logit bias,
    allowed tokens and bad words, penalties). Log-probabilities, of the sampled token and of the top-N, are those of the
    model's raw distribution: before logit bias, penalties, temperature, top-k and top-p
    (vLLM's default); under a grammar, of that distribution restricted to the tokens the
    grammar allows.
    grammar_bitmask: [num_reqs, ceil(vocab / 32)] int32, bit t of a row set where token t is
    allowed (see `engine.structured_output`), or None when no row has a grammar.
    """
    if grammar_bitmask is not None:
        logits = apply_grammar_masks(logits, grammar_bitmask)
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
    if adjustments is not None:
        adjust_logits(logits, adjustments)
    token_ids = logits.argmax(dim=-1)  # [num_reqs]
    for row, p in enumerate(params):
        if not p.greedy:
            probs = _filtered_probs(logits[row], p)  # [vocab]
            token_ids[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return SamplerOutput(token_ids.tolist(), chosen.tolist(), _top_logprobs(logprobs, params))


def _top_logprobs(logprobs: torch.Tensor, params: list[SamplingParams]) -> list[TopLogprobs | None]:
    """Each row's `logprobs` likeliest tokens, from one top-k over the batch."""
    wanted = [p.logprobs or 0 for p in params]
    k = min(max(wanted), logprobs.shape[-1])
    if k == 0:
        return [None] * len(params)
    values, indices = logprobs.topk(k, dim=-1)  # [num_reqs, k]
    values_list, indices_list = values.tolist(), indices.tolist()
    return [
        TopLogprobs(tuple(ids[:n]), tuple(vals[:n])) if n else None
        for n, ids, vals in zip(wanted, indices_list, values_list)
    ]


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num_top: int
) -> PromptLogprobs:
    """Of the model's raw distribution at each position (logits: [P, vocab]), the logprob
    and rank of the token that follows it in the prompt, and the `num_top` likeliest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, vocab]
    ids = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)  # [P]
    chosen = logprobs.gather(1, ids.unsqueeze(1))  # [P, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [P]
    if num_top:
        values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # [P, k]
        top = [TopLogprobs(tuple(i), tuple(v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        top = [TopLogprobs((), ())] * len(next_token_ids)
    return PromptLogprobs(list(next_token_ids), chosen.squeeze(1).tolist(), ranks.tolist(), top)


def apply_grammar_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token a row's grammar forbids at -inf: [num_reqs, vocab].

    bitmask: [num_reqs, words] int32 on the CPU, little-endian: token t is bit t % 32 of
    word t // 32, so its bytes unpack in token order."""
    num_reqs, vocab = logits.shape
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab]).to(logits.device, torch.bool)  # [num_reqs, vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p (nucleus) on one row of logits: [vocab]."""
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0:  # the likeliest token always stays
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()  # top-p takes its share of what min-p kept
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False  # even when top_p underflows float32 (1e-300 compares as 0)
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator for a seeded request, seeded before each draw (see
    `position_seed`); None uses torch's global RNG."""
    return None if seed is None else torch.Generator(device=device)


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for the token at `position` of a seeded request's sequence. A
    function of the position alone, so the draws do not depend on where earlier tokens were
    sampled: a D continuing after P's first token samples what a colocated instance would."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & mask  # splitmix64's finalizer below
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)

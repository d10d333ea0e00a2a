"""Token sampling for one step's batch of logits."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Pick one token per row and return (token_ids, logprobs of those tokens).

    logits: [num_reqs, vocab] float32. Log-probabilities are those of the model's own
    distribution (before temperature / top-k / top-p), as in vLLM.
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
    token_ids = logits.argmax(dim=-1)  # [num_reqs]
    for row, p in enumerate(params):
        if not p.greedy:
            probs = _filtered_probs(logits[row], p)  # [vocab]
            token_ids[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return token_ids.tolist(), chosen.tolist()


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of logits: [vocab]."""
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
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

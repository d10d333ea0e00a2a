"""Token sampling for one step's batch of logits."""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    grammar_bitmask: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """Pick one token per row and return (token_ids, logprobs of those tokens).

    logits: [num_reqs, vocab] float32. Log-probabilities are those of the model's own
    distribution (before temperature / top-k / top-p), as in vLLM; under a grammar, of that
    distribution restricted to the tokens the grammar allows.
    grammar_bitmask: [num_reqs, ceil(vocab / 32)] int32, bit t of a row set where token t is
    allowed (see `engine.structured_output`), or None when no row has a grammar.
    """
    if grammar_bitmask is not None:
        logits = apply_grammar_masks(logits, grammar_bitmask)
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
    token_ids = logits.argmax(dim=-1)  # [num_reqs]
    for row, p in enumerate(params):
        if not p.greedy:
            probs = _filtered_probs(logits[row], p)  # [vocab]
            token_ids[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return token_ids.tolist(), chosen.tolist()


def apply_grammar_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token a row's grammar forbids at -inf: [num_reqs, vocab].

    bitmask: [num_reqs, words] int32 on the CPU, little-endian: token t is bit t % 32 of
    word t // 32, so its bytes unpack in token order."""
    num_reqs, vocab = logits.shape
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab]).to(logits.device, torch.bool)  # [num_reqs, vocab]
    return logits.masked_fill(~allowed, float("-inf"))


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
    """A per-request generator for a seeded request; None uses torch's global RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen

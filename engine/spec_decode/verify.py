"""Verification of draft tokens: what a step that scored K drafts emits.

The target scores the request's last token and its K drafts in one forward pass, giving
K + 1 rows of logits; row i is the distribution after the drafts before i. Every row is
sampled by the normal sampler (`engine.sampler.sample`, with the request's temperature,
top-k/p, penalties counting the drafts before the row, seeds and logprobs), giving a target
token x_i per row, and the step emits x_0 .. x_a, where a is the number of leading drafts
equal to their x_i: each accepted draft, then the target's token at the first mismatch, or
the bonus token x_K after all K.

At temperature 0, x_i is the argmax, so the output is the one without speculation. At
temperature > 0 this is rejection sampling for a deterministic draft (an n-gram draft is a
point mass q = 1 on d_i): accept d_i with probability min(1, p(d_i) / q(d_i)) = p(d_i),
else emit a token from the residual max(0, p - q), which is p with d_i removed, renormalised.
Drawing x_i ~ p and accepting iff x_i == d_i does both with one draw: P(accept) = p(d_i),
and after a rejection x_i is distributed as p given x_i != d_i. Each emitted token is
therefore distributed exactly as the target's, and a seeded request draws each position
from that position's seed, so it emits what it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's token at their position.

    target_token_ids: one per verified row, len(draft_token_ids) + 1."""
    n = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        n += 1
    return n

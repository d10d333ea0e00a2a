"""Prompt lookup: propose the tokens that followed an earlier occurrence of the last n-gram.

Input-grounded outputs (a rewrite, an annotated copy, an answer quoting its context) repeat
long runs of their prompt, so the tokens after an earlier occurrence of the output's last n
tokens are likely what the model writes next. The lookup costs O(len(tokens) * n) numpy
work per request and step, no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdcluster.engine.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        """Draft tokens to follow `token_ids` (prompt + output so far), at most
        min(num_speculative_tokens, max_num_tokens) of them; [] when no n-gram matches."""
        num_tokens = min(self.num_speculative_tokens, max_num_tokens)
        if num_tokens < 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        return propose_ngram(tokens, self.min_n, self.max_n, num_tokens)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The `num_tokens` tokens (fewer at the end of `tokens`) that follow the earliest
    occurrence of the longest suffix n-gram of `tokens` (min_n <= n <= max_n) that also
    ends earlier in `tokens`; [] when there is none.

    tokens: [L] int64. match_len[e], for each earlier end position e < L - 1, counts how
    many tokens ending at e equal the suffix's, up to max_n."""
    num_ends = tokens.size - 1
    max_n = min(max_n, num_ends)
    if max_n < min_n:
        return []
    match_len = np.zeros(num_ends, dtype=np.int32)  # [L - 1]
    alive = np.ones(num_ends, dtype=bool)  # tokens ending at e match the suffix so far
    for j in range(max_n):  # compare tokens[e - j] with the suffix's token tokens[L - 1 - j]
        alive[:j] = False  # no token at e - j < 0
        alive[j:] &= tokens[: num_ends - j] == tokens[num_ends - j]
        if not alive.any():
            break
        match_len += alive
    end = int(match_len.argmax())  # the earliest among the longest
    if match_len[end] < min_n:
        return []
    return tokens[end + 1 : end + 1 + num_tokens].tolist()

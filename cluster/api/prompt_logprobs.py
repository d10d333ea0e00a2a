"""Prompt log-probabilities in the response shapes clients read: vLLM's `prompt_logprobs`
(both endpoints) and, for `echo` with `logprobs` on completions, OpenAI's legacy `logprobs`
object covering the echoed prompt's tokens before the generated ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdcluster.cluster.api.serving import Serving
from pdcluster.engine.outputs import PromptLogprobs, TopLogprobs
from pdcluster.engine.sampling_params import SamplingParams


def echoed_params(params: SamplingParams, echo: bool, logprobs: int | None) -> SamplingParams:
    """An echoed prompt comes with the logprobs its completion asks for (vLLM's rule: the
    prompt's then follow `logprobs`, whatever `prompt_logprobs` says)."""
    if not echo or logprobs is None:
        return params
    return dataclasses.replace(params, prompt_logprobs=logprobs)


def prompt_logprobs_json(
    serving: Serving, found: PromptLogprobs | None
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's shape: None for the first prompt token, then per token {token id: {logprob,
    rank, decoded_token}} of the token itself and of the likeliest alternatives."""
    if found is None:
        return None
    out: list[dict[int, dict[str, Any]] | None] = [None]
    for token_id, logprob, rank, top in zip(
        found.token_ids, found.logprobs, found.ranks, found.top
    ):
        entry = {token_id: _logprob(serving, token_id, logprob, rank)}
        for alt_rank, (alt_id, alt_lp) in enumerate(zip(top.token_ids, top.logprobs), 1):
            entry.setdefault(alt_id, _logprob(serving, alt_id, alt_lp, alt_rank))
        out.append(entry)
    return out


def _logprob(serving: Serving, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": serving.token_text(token_id)}


@dataclass
class LegacyLogprobs:
    """OpenAI's legacy completion `logprobs`, token by token (None where a token has no
    logprob: the first of an echoed prompt)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)

    def extend(self, other: LegacyLogprobs) -> LegacyLogprobs:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        return self

    def as_json(self, first_offset: int = 0) -> dict[str, Any]:
        """`text_offset`: where each token starts in the concatenation of the choice's token
        texts, the first at `first_offset` (a stream's tokens sent before); that is the
        choice's text wherever its tokens decode one by one as they do together."""
        offsets, at = [], first_offset
        for token in self.tokens:
            offsets.append(at)
            at += len(token)
        return {**dataclasses.asdict(self), "text_offset": offsets}


def legacy_entries(
    serving: Serving,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[TopLogprobs],
    as_ids: bool = False,
) -> LegacyLogprobs:
    """Generated tokens: each with its logprob and a {token: logprob} of its alternatives and
    itself (`tops` is empty when no alternatives were asked; `as_ids`: tokens spelled
    "token_id:N")."""
    out = LegacyLogprobs()
    for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
        token = serving.token_text(token_id, as_ids)
        entry = dict(serving.alternatives(tops[i], as_ids)) if tops else {}
        entry.setdefault(token, lp)
        out.add(token, lp, entry)
    return out


def echoed_entries(
    serving: Serving, prompt_token_ids: list[int], found: PromptLogprobs | None, as_ids: bool
) -> LegacyLogprobs:
    """An echoed prompt's tokens: the first without a logprob, the others with theirs."""
    out = LegacyLogprobs()
    out.add(serving.token_text(prompt_token_ids[0], as_ids), None, None)
    if found is not None:
        out.extend(legacy_entries(serving, found.token_ids, found.logprobs, found.top, as_ids))
    return out

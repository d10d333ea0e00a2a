"""A request's sequences as they accumulate: a `Result` per sequence, a `Group` per prompt
(its n or best_of sequences), and what the endpoints compute from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdcluster.engine.outputs import PromptLogprobs, TopLogprobs
from pdcluster.engine.request import Request as EngineRequest


@dataclass
class Result:
    """One sequence's output as it accumulates."""

    index: int  # its choice's
    prompt_index: int  # the prompt it samples: usage counts each prompt once
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # of the prompt's, found in an instance's prefix cache
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when alternatives were asked
    prompt_logprobs: PromptLogprobs | None = None  # when asked (or echoed with logprobs)
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # the error was the cluster's (see EngineCoreOutput)

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


@dataclass
class Group:
    """The sequences sampling one prompt (n, best_of), run together (`stream_group`)."""

    requests: list[EngineRequest]
    results: list[Result]


def usage(results: list[Result]) -> dict[str, int]:
    """Each prompt counted once, however many sequences sampled it; every sequence's tokens."""
    prompt = sum({r.prompt_index: r.num_prompt_tokens for r in results}.values())
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def best(results: list[Result], n: int) -> list[Result]:
    """The n results of one prompt with the highest cumulative log-probability (best_of),
    as choices numbered after the prompt's."""
    if len(results) == n:
        return results
    ranked = sorted(results, key=lambda r: r.cumulative_logprob, reverse=True)[:n]
    return [dataclasses.replace(r, index=r.prompt_index * n + i) for i, r in enumerate(ranked)]

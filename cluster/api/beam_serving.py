"""Beam search on the cluster, for both generating endpoints (`use_beam_search`).

Every step sends one ordinary max_tokens=1 request per live beam (its prompt: the prompt and
the beam's tokens), asking for 2 x beam_width alternatives; the beams of one prompt go as one
group, so they are planned onto one instance together and share the prompt's prefix blocks
(the repeated prompts cost one token each). It works on every topology: a one-token request
runs on P alone, or on a mixed instance. `cluster.api.beam_search` ranks the beams.
"""

from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest

from pdcluster.cluster.api.beam_search import BeamSearch, BeamSearchParams
from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.completions_protocol import CompletionRequest
from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.results import Group, Result
from pdcluster.cluster.api.serving import Serving
from pdcluster.engine.outputs import TopLogprobs
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.routing.handoff import max_new_tokens


async def run_to_end(
    serving: Serving,
    http: HTTPRequest,
    groups: list[Group],
    body: CompletionRequest | ChatCompletionRequest,
) -> None:
    """A non-streamed request's groups into their results: sampled, or beam-searched."""
    if body.use_beam_search:
        await run_beam_search(serving, http, groups, body.length_penalty)
    else:
        await serving.runner.run_to_end(http, groups)


async def run_beam_search(
    serving: Serving, http: HTTPRequest, groups: list[Group], length_penalty: float
) -> None:
    """Beam-search each group's prompt (its requests only name the prompt and parameters);
    its results become the best beams, best first. A failure cancels the other prompts'."""
    tasks = [
        asyncio.ensure_future(_search(serving, http, group, length_penalty)) for group in groups
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _search(serving: Serving, http: HTTPRequest, group: Group, length_penalty: float) -> None:
    base = group.requests[0]
    p = base.sampling_params
    if p.structured_outputs is not None:
        raise APIError(
            400, "use_beam_search cannot follow a grammar (a forced tool call or a format)",
            "unsupported_value", "use_beam_search",
        )  # fmt: skip
    params = BeamSearchParams(
        beam_width=len(group.results),
        max_tokens=max_new_tokens(base, serving.max_model_len),
        num_prompt_tokens=base.num_prompt_tokens,
        eos_token_ids=frozenset() if p.ignore_eos else base.eos_token_ids,
        stop_token_ids=frozenset(p.stop_token_ids),
        stop=tuple(p.stop),
        length_penalty=length_penalty,
        include_stop_str_in_output=p.include_stop_str_in_output,
        min_tokens=p.min_tokens,
    )
    tokenizer = serving.tokenizer
    search = BeamSearch(
        params, lambda ids: tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    )
    num_alternatives = max(params.num_candidates, p.logprobs or 0)
    prompt_logprobs = None
    while not search.done:
        step = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            logprobs=num_alternatives,
            prompt_logprobs=p.prompt_logprobs if search.num_steps == 0 else None,
        )
        results = await _expand(serving, http, base, search, step)
        prompt_logprobs = prompt_logprobs or results[0].prompt_logprobs
        search.step([r.top_logprobs[0] for r in results])
    for result, beam in zip(group.results, search.best()):
        result.text, result.token_ids, result.logprobs = beam.text, beam.token_ids, beam.logprobs
        result.top_logprobs = [_first(t, p.logprobs or 0) for t in beam.top_logprobs]
        result.finish_reason = beam.finish_reason
        result.prompt_logprobs = prompt_logprobs


async def _expand(
    serving: Serving, http: HTTPRequest, base: Request, search: BeamSearch, step: SamplingParams
) -> list[Result]:
    """One max_tokens=1 request per live beam, run together; their results."""
    requests = [
        Request(
            f"{base.request_id}-beam{search.num_steps}.{i}",
            base.prompt_token_ids + beam.token_ids,
            step,
            eos_token_ids=base.eos_token_ids,
            mm_features=base.mm_features,
            cache_salt=base.cache_salt,  # a tenant's beams share only its own blocks
            priority=base.priority,
            lora_request=base.lora_request,
        )
        for i, beam in enumerate(search.live)
    ]
    results = [Result(i, 0, r.num_prompt_tokens) for i, r in enumerate(requests)]
    await serving.runner.run_to_end(http, [Group(requests, results)])
    return results


def _first(top: TopLogprobs, n: int) -> TopLogprobs:
    return TopLogprobs(top.token_ids[:n], top.logprobs[:n])

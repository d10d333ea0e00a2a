"""The requests P and D run for one disaggregated request. No Ray here.

P computes the prompt and one token with `do_remote_decode`, then holds the KV; D continues
from the prompt plus that token, reading P's KV through the `kv_transfer_params` P returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.request import Request
from engine.sampling_params import SamplingParams


def max_new_tokens(request: Request, max_model_len: int) -> int:
    """The most tokens the request may still generate."""
    room = max_model_len - request.num_prompt_tokens
    asked = request.sampling_params.max_tokens
    return room if asked is None else min(asked, room)


def for_prefill(request: Request) -> Request:
    """P computes the prompt and one token, then holds the KV for D."""
    params = dataclasses.replace(request.sampling_params, max_tokens=1, min_tokens=0)
    return _copy(request, request.prompt_token_ids, params, {"do_remote_decode": True})


def for_decode(request: Request, first_token: int, kv_transfer_params: dict[str, Any]) -> Request:
    """D continues after P's first token, reading the prompt's KV from P (and its grammar,
    if any, from where that token left it)."""
    p = request.sampling_params
    structured = p.structured_outputs
    if structured is not None:
        prefix = (*structured.prefix_token_ids, first_token)
        structured = dataclasses.replace(structured, prefix_token_ids=prefix)
    params = dataclasses.replace(
        p,
        max_tokens=None if p.max_tokens is None else p.max_tokens - 1,
        min_tokens=max(0, p.min_tokens - 1),
        structured_outputs=structured,
        prompt_logprobs=None,  # P computed (and reported) them
    )
    prompt = [*request.prompt_token_ids, first_token]
    return _copy(request, prompt, params, kv_transfer_params, request.num_prior_output_tokens + 1)


def _copy(
    request: Request,
    prompt: list[int],
    params: SamplingParams,
    kv_transfer_params: dict[str, Any],
    num_prior_output_tokens: int = 0,
) -> Request:
    return Request(
        request.request_id,
        prompt,
        params,
        eos_token_ids=request.eos_token_ids,
        mm_features=request.mm_features,
        kv_transfer_params=kv_transfer_params,
        arrival_time=request.arrival_time,
        num_prior_output_tokens=num_prior_output_tokens,
        cache_salt=request.cache_salt,
        priority=request.priority,
    )

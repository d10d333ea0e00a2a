"""The requests P and D run for one disaggregated request, and the one a stream resumes
with on other instances after its instance died. No Ray here.

P computes the prompt and one token with `do_remote_decode`, then holds the KV; D continues
from the prompt plus that token, reading P's KV through the `kv_transfer_params` P returned.
A resumed request continues the same way from the prompt plus every token the client got:
those tokens count as output (penalties, `min_tokens`, `max_tokens`, the grammar, seeded
draws by position), and their text as text already sent (stop strings, held-back text).
"""

from __future__ import annotations

import dataclasses

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams


def max_new_tokens(request: Request, max_model_len: int) -> int:
    """The most tokens the request may still generate."""
    room = max_model_len - request.num_prompt_tokens
    asked = request.sampling_params.max_tokens
    return room if asked is None else min(asked, room)


def for_prefill(request: Request) -> Request:
    """P computes the prompt and one token, then holds the KV for D."""
    params = dataclasses.replace(request.sampling_params, max_tokens=1, min_tokens=0)
    return _copy(
        request, request.prompt_token_ids, params, KVTransferParams.remote_decode(),
        request.num_prior_output_tokens, request.prior_output_text,
    )  # fmt: skip


def for_decode(
    request: Request,
    first_token: int,
    kv_transfer_params: KVTransferParams,
    first_text: str = "",
) -> Request:
    """D continues after P's first token (whose text was `first_text`), reading the prompt's
    KV from P (and its grammar, if any, from where that token left it)."""
    params = _continued(request.sampling_params, [first_token])
    prompt = [*request.prompt_token_ids, first_token]
    text = None if request.prior_output_text is None else request.prior_output_text + first_text
    num_prior = request.num_prior_output_tokens + 1
    return _copy(request, prompt, params, kv_transfer_params, num_prior, text)


def resume(request: Request, request_id: str, token_ids: list[int], text: str) -> Request:
    """`request` (a client's, as first planned) continuing under `request_id` after the
    output `token_ids` (whose text was `text`) reached its client. Nothing sent: a plain
    copy."""
    if not token_ids:
        return _copy(request, request.prompt_token_ids, request.sampling_params,
                     request.kv_transfer_params, request_id=request_id)  # fmt: skip
    params = _continued(request.sampling_params, token_ids)
    prompt = [*request.prompt_token_ids, *token_ids]
    return _copy(request, prompt, params, None, len(token_ids), text, request_id)


def _continued(p: SamplingParams, token_ids: list[int]) -> SamplingParams:
    """The sampling of a request whose first `token_ids` were generated elsewhere: the
    remaining `max_tokens` and `min_tokens`, its grammar past those tokens, and no prompt
    logprobs (the output that carried the first token reported them)."""
    structured = p.structured_outputs
    if structured is not None:
        prefix = (*structured.prefix_token_ids, *token_ids)
        structured = dataclasses.replace(structured, prefix_token_ids=prefix)
    n = len(token_ids)
    return dataclasses.replace(
        p,
        max_tokens=None if p.max_tokens is None else p.max_tokens - n,
        min_tokens=max(0, p.min_tokens - n),
        structured_outputs=structured,
        prompt_logprobs=None,
    )


def _copy(
    request: Request,
    prompt: list[int],
    params: SamplingParams,
    kv_transfer_params: KVTransferParams | None,
    num_prior_output_tokens: int = 0,
    prior_output_text: str | None = None,
    request_id: str | None = None,
) -> Request:
    return Request(
        request.request_id if request_id is None else request_id,
        prompt,
        params,
        eos_token_ids=request.eos_token_ids,
        mm_features=request.mm_features,
        kv_transfer_params=kv_transfer_params,
        arrival_time=request.arrival_time,
        num_prior_output_tokens=num_prior_output_tokens,
        prior_output_text=prior_output_text,
        cache_salt=request.cache_salt,
        priority=request.priority,
        lora_request=request.lora_request,
    )

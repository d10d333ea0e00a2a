"""The sequences one client request samples from one prompt (`n`, `best_of`). No Ray here.

Each sequence is a request of its own with the same prompt; the Front plans them together
(`Front.stream_group`), so the prompt's KV is computed once on their P (or mixed instance)
and shared through its prefix cache.
"""

from __future__ import annotations

import dataclasses

from pdcluster.engine.request import Request


def fan_out(request: Request, num_seqs: int) -> list[Request]:
    """`num_seqs` requests sampling `request`'s prompt, with ids `{id}-{i}` (the request itself
    when one). Child i of a seeded request uses seed + i: reproducible, distinct, and child 0
    samples what the request alone would."""
    if num_seqs == 1:
        return [request]
    return [_child(request, i) for i in range(num_seqs)]


def _child(request: Request, index: int) -> Request:
    params = request.sampling_params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + index)
    return Request(
        f"{request.request_id}-{index}",
        request.prompt_token_ids,
        params,
        eos_token_ids=request.eos_token_ids,
        mm_features=request.mm_features,
        kv_transfer_params=request.kv_transfer_params,
        arrival_time=request.arrival_time,
        num_prior_output_tokens=request.num_prior_output_tokens,
        prior_output_text=request.prior_output_text,
        cache_salt=request.cache_salt,
        priority=request.priority,
        lora_request=request.lora_request,
    )

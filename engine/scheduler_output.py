"""What a step's runner output does to one request: its sampled tokens appended, its stop
conditions checked, its prompt logprobs gathered; and the output its client sees. Only the
scheduler calls these.
"""

from __future__ import annotations

from pdcluster.connectors.base import KVTransferParams
from pdcluster.engine.outputs import EngineCoreOutput, PromptLogprobs, TopLogprobs
from pdcluster.engine.request import Request, RequestStatus


def append_tokens(
    request: Request,
    token_ids: list[int],
    logprobs: list[float] | None,
    top_logprobs: list[TopLogprobs] | None,
    grammar_done: bool,
    max_model_len: int,
) -> EngineCoreOutput:
    """Append sampled tokens up to the first that finishes the request (whose status is
    then set); `grammar_done`: the request's grammar is complete after the last of them."""
    prompt_lps = None if request.output_token_ids else take_prompt_logprobs(request)
    new_token_ids = token_ids
    status = None
    for j, token_id in enumerate(token_ids):
        request.output_token_ids.append(token_id)
        if logprobs:
            request.output_logprobs.append(logprobs[j])
        done = grammar_done and j == len(token_ids) - 1
        status = check_stop(request, token_id, max_model_len, done)
        if status is not None:
            new_token_ids = token_ids[: j + 1]
            break
    output = EngineCoreOutput(
        request.request_id,
        new_token_ids,
        logprobs[: len(new_token_ids)] if logprobs else None,
        top_logprobs[: len(new_token_ids)] if top_logprobs else None,
        prompt_logprobs=prompt_lps,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        queue_time_s=request.queue_time_s,
    )
    request.queue_time_s = None
    if status is not None:
        request.status = status
        output.finish_reason = request.get_finished_reason()
        output.stop_reason = request.stop_reason
    return output


def load_failed_output(request: Request, params: KVTransferParams | None) -> EngineCoreOutput:
    """The last output of a request whose remote KV load failed (kv_load_failure_policy
    'fail'): the KV's producer is gone or late, so elsewhere the request may succeed."""
    return EngineCoreOutput(
        request.request_id,
        [],
        finish_reason="error",
        error=request.error,
        kv_transfer_params=params,
        unavailable=True,
    )


def check_stop(
    request: Request, token_id: int, max_model_len: int, grammar_done: bool = False
) -> RequestStatus | None:
    """The finished status `token_id` (just appended) puts the request in, if any. Stop
    strings are not checked here: the engine core's detokenizer calls finish_requests.
    A complete grammar (`grammar_done`) stops the request: it allows no further token."""
    params = request.sampling_params
    if grammar_done:
        return RequestStatus.FINISHED_STOPPED
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output + len(request.prompt_token_ids) >= max_model_len or (
        params.max_tokens is not None and num_output >= params.max_tokens
    ):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def add_prompt_logprobs(request: Request, chunk: PromptLogprobs | None) -> None:
    """Keep a prefill chunk's prompt logprobs until the request's first output."""
    if chunk is None:
        return
    if request.prompt_logprobs is None:
        request.prompt_logprobs = PromptLogprobs()
    request.prompt_logprobs.extend(chunk)


def take_prompt_logprobs(request: Request) -> PromptLogprobs | None:
    """For the request's first output: its prompt logprobs, when it asked for them (a
    one-token prompt has none)."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    found, request.prompt_logprobs = request.prompt_logprobs, None
    return found or PromptLogprobs()

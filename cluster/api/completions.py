"""`/v1/completions`: prompts (text or token ids, batched) to text, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api.beam_serving import run_to_end
from pdcluster.cluster.api.completions_protocol import CompletionRequest
from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.prompt_logprobs import (
    echoed_entries,
    echoed_params,
    legacy_entries,
    prompt_logprobs_json,
)
from pdcluster.cluster.api.results import Group, Result, best, usage
from pdcluster.cluster.api.serving import Serving
from pdcluster.cluster.api.sse import DONE, ChunkEncoder, EventStreamResponse, UsageIn


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, http: Request) -> Response:
        serving = self.serving
        body = await serving.parse(http, CompletionRequest)
        rid = f"cmpl-{serving.request_id(http, body)}"
        try:
            prompts = body.prompts()
            limit = serving.settings.max_batch_prompts
            if len(prompts) > limit:
                raise APIError(
                    400,
                    f"prompt: a batch holds at most {limit} prompts, this one {len(prompts)}",
                    "invalid_value",
                    "prompt",
                )
            num_seqs = body.n if body.use_beam_search else body.num_seqs()  # n: the beams
            # best_of ranks sequences by their cumulative log-probability
            logprobs = 0 if body.logprobs is None and num_seqs > body.n else body.logprobs
            asked_by = "n" if num_seqs == body.n else "best_of"
            params = serving.sampling_params(body, body.max_tokens, logprobs)
            params = echoed_params(params, body.echo, body.logprobs)
            await serving.check_grammar(params, body.grammar()[0])
            groups = [
                serving.group(
                    j, serving.make(self._tokens(p, body), params, body, rid), num_seqs, asked_by
                )
                for j, p in enumerate(prompts)
            ]
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from None
        serving.log_received(rid, body, groups)
        echoes = [self._echo(p) for p in prompts] if body.echo else None
        as_ids = body.return_tokens_as_token_ids
        headers = {"X-Request-Id": rid}
        if body.stream:
            usage_in = UsageIn.of(body.stream_options)
            chunks = self._chunks(rid, groups, usage_in, body.logprobs, echoes, as_ids)
            return EventStreamResponse(chunks, headers)
        await run_to_end(serving, http, groups, body)
        results = [r for g in groups for r in best(g.results, body.n)]
        prompt_ids = [g.requests[0].prompt_token_ids for g in groups]
        choices = [self._choice(r, body.logprobs, prompt_ids, echoes, as_ids) for r in results]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": serving.model_of(groups[0].requests[0]),
                "choices": choices,
                "usage": usage([r for g in groups for r in g.results]),
            },
            headers=headers,
        )

    def _tokens(self, prompt: str | list[int], body: CompletionRequest) -> str | list[int]:
        """A text prompt as token ids when it gets no special tokens (add_special_tokens)."""
        if isinstance(prompt, list) or body.add_special_tokens:
            return prompt
        tokens = self.serving.tokenizer.encode(self.serving.fits(prompt), add_special_tokens=False)
        if not tokens:
            raise ValueError("prompt is empty")
        return tokens

    def _echo(self, prompt: str | list[int]) -> str:
        """The prompt as `echo` puts it before a completion's text."""
        if isinstance(prompt, str):
            return prompt
        return self.serving.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _chunks(
        self,
        rid: str,
        groups: list[Group],
        usage_in: UsageIn,
        logprobs: int | None,
        echoes: list[str] | None,
        as_ids: bool,
    ) -> AsyncGenerator[bytes, None]:
        """An echo goes first; with logprobs it waits for the prompt's, which come with its
        sequence's first output, and goes out in that chunk."""
        model = self.serving.model_of(groups[0].requests[0])
        sse = ChunkEncoder(rid, "text_completion", int(time.time()), model)
        results = [r for g in groups for r in g.results]
        prompt_ids = [g.requests[0].prompt_token_ids for g in groups]
        # by choice index: the tokens' text sent so far, where the next text_offset starts
        num_chars = [0] * len(results)
        echo_pending = {r.index for r in results} if echoes and logprobs is not None else set()
        for result in results if echoes and not echo_pending else []:
            text = echoes[result.prompt_index]
            choice = {"index": result.index, "text": text, "logprobs": None, "finish_reason": None}
            yield sse.event([choice])
        async with contextlib.aclosing(self.serving.runner.merged(groups)) as outputs:
            async for result, out in outputs:
                text, entries = out.new_text, None
                if logprobs is not None:
                    ids, lps = out.new_token_ids, out.new_logprobs or []
                    tops = out.new_top_logprobs or []
                    entries = legacy_entries(self.serving, ids, lps, tops, as_ids)
                if result.index in echo_pending:
                    echo_pending.discard(result.index)
                    text = echoes[result.prompt_index] + text
                    prompt = prompt_ids[result.prompt_index]
                    echoed = echoed_entries(self.serving, prompt, out.prompt_logprobs, as_ids)
                    entries = echoed.extend(entries)
                choice = {
                    "index": result.index,
                    "text": text,
                    "logprobs": None
                    if entries is None
                    else entries.as_json(num_chars[result.index]),
                    "finish_reason": out.finish_reason,
                }
                if entries is not None:
                    num_chars[result.index] += sum(len(t) for t in entries.tokens)
                if out.finish_reason == "error":
                    choice["error"] = out.error
                yield sse.event([choice], usage(results) if usage_in.every_chunk else None)
        if usage_in.last_chunk:
            yield sse.event([], usage(results))
        yield DONE

    def _choice(
        self,
        result: Result,
        wanted: int | None,
        prompt_ids: list[list[int]],
        echoes: list[str] | None,
        as_ids: bool,
    ) -> dict[str, Any]:
        """A non-streamed choice; its `logprobs` in OpenAI's legacy shape (see
        `cluster.api.prompt_logprobs`), with `echo` the prompt's tokens first."""
        text, logprobs = result.text, None
        if wanted is not None:
            logprobs = legacy_entries(
                self.serving, result.token_ids, result.logprobs, result.top_logprobs, as_ids
            )
        if echoes:
            text = echoes[result.prompt_index] + text
            prompt = prompt_ids[result.prompt_index]
            if logprobs is not None:
                echoed = echoed_entries(self.serving, prompt, result.prompt_logprobs, as_ids)
                logprobs = echoed.extend(logprobs)
        return {
            "index": result.index,
            "text": text,
            "logprobs": None if logprobs is None else logprobs.as_json(),
            "finish_reason": result.finish_reason,
            "prompt_logprobs": prompt_logprobs_json(self.serving, result.prompt_logprobs),
        }

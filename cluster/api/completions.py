"""`/v1/completions`: prompts (text or token ids, batched) to text, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cluster.api.errors import APIError
from cluster.api.protocol import CompletionRequest
from cluster.api.serving import Group, Serving, best, usage
from cluster.api.sse import DONE, ChunkEncoder, EventStreamResponse, UsageIn
from engine.outputs import TopLogprobs


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
            num_seqs = body.num_seqs()
            # best_of ranks sequences by their cumulative log-probability
            logprobs = 0 if body.logprobs is None and num_seqs > body.n else body.logprobs
            asked_by = "n" if num_seqs == body.n else "best_of"
            params = serving.sampling_params(body, body.max_tokens, logprobs)
            await serving.check_grammar(params, body.grammar()[0])
            groups = [
                serving.group(
                    j, serving.make(self._tokens(p, body), params, rid), num_seqs, asked_by
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
        await serving.run_to_end(http, groups)
        results = [r for g in groups for r in best(g.results, body.n)]
        choices = [
            {
                "index": r.index,
                "text": (echoes[r.prompt_index] if echoes else "") + r.text,
                "logprobs": self._logprobs(
                    r.token_ids, r.logprobs, r.top_logprobs, body.logprobs, as_ids
                ),
                "finish_reason": r.finish_reason,
            }
            for r in results
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": serving.model_name,
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
        sse = ChunkEncoder(rid, "text_completion", int(time.time()), self.serving.model_name)
        results = [r for g in groups for r in g.results]
        for result in results if echoes else []:
            text = echoes[result.prompt_index]
            choice = {"index": result.index, "text": text, "logprobs": None, "finish_reason": None}
            yield sse.event([choice])
        async with contextlib.aclosing(self.serving.merged(groups)) as outputs:
            async for result, out in outputs:
                choice = {
                    "index": result.index,
                    "text": out.new_text,
                    "logprobs": self._logprobs(
                        out.new_token_ids,
                        out.new_logprobs or [],
                        out.new_top_logprobs or [],
                        logprobs,
                        as_ids,
                    ),
                    "finish_reason": out.finish_reason,
                }
                if out.finish_reason == "error":
                    choice["error"] = out.error
                yield sse.event([choice], usage(results) if usage_in.every_chunk else None)
        if usage_in.last_chunk:
            yield sse.event([], usage(results))
        yield DONE

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        wanted: int | None,
        as_ids: bool = False,
    ) -> dict[str, Any] | None:
        """OpenAI's legacy shape: per token, a {token: logprob} of the likeliest `wanted`
        and the sampled one (`tops` is empty when no alternatives were asked)."""
        if wanted is None:
            return None
        tokens = [self.serving.token_text(t, as_ids) for t in token_ids]
        top_logprobs = []
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            entry = dict(self.serving.alternatives(tops[i], as_ids)) if tops else {}
            entry.setdefault(token, lp)
            top_logprobs.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": None,
        }

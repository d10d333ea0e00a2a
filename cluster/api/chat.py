"""`/v1/chat/completions`: messages (text and images) rendered by the model's chat template,
answered whole or streamed, with tool calls read from the output."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdcluster.cluster.api.beam_serving import run_to_end
from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.prompt_logprobs import prompt_logprobs_json
from pdcluster.cluster.api.results import Group, Result, usage
from pdcluster.cluster.api.serving import Serving
from pdcluster.cluster.api.sse import DONE, ChunkEncoder, EventStreamResponse, UsageIn
from pdcluster.cluster.api.tools import ToolCalling
from pdcluster.engine.outputs import TopLogprobs
from pdcluster.engine.sampling_params import SamplingParams, StructuredOutputsParams


class Chat:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def __call__(self, http: Request) -> Response:
        serving = self.serving
        body = await serving.parse(http, ChatCompletionRequest)
        rid = f"chatcmpl-{serving.request_id(http, body)}"
        group, calling = await self.prepare(body, rid)
        serving.log_received(rid, body, [group])
        as_ids = body.return_tokens_as_token_ids
        headers = {"X-Request-Id": rid}
        if body.stream:
            usage_in = UsageIn.of(body.stream_options)
            chunks = self._chunks(rid, group, usage_in, body.logprobs, calling, as_ids)
            return EventStreamResponse(chunks, headers)
        await run_to_end(serving, http, [group], body)
        choices = [self._choice(r, body, calling) for r in group.results]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": serving.model_of(group.requests[0]),
                "choices": choices,
                "usage": usage(group.results),
                # vLLM's place for them; each choice carries its own too
                "prompt_logprobs": choices[0]["prompt_logprobs"],
            },
            headers=headers,
        )

    async def prepare(
        self, body: ChatCompletionRequest, rid: str, format_field: str | None = None
    ) -> tuple[Group, ToolCalling | None]:
        """The body's sequences (named after `rid`), ready to run, and how their output
        becomes tool calls (`format_field`: the field that names the output's format, for
        its errors, when not the chat body's own)."""
        serving = self.serving
        try:
            calling = ToolCalling.of(body, serving.tool_parser)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value", "tool_choice") from None
        try:
            rendered = serving.renderer.render(body, body.add_generation_prompt, calling)
            text = serving.fits(rendered)
            token_ids = serving.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
            images = [await serving.fetch_image(url) for url in body.image_urls()]
            prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            params = serving.sampling_params(body, body.max_new_tokens(), body.num_logprobs())
            params, asked_by = _with_tool_calling(
                params, calling, format_field or body.grammar()[0]
            )
            await serving.check_grammar(params, asked_by)
            group = serving.group(0, serving.make(prompt, params, body, rid), body.n, "n")
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from None
        return group, calling

    def _choice(
        self, r: Result, body: ChatCompletionRequest, calling: ToolCalling | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        finish_reason = r.finish_reason
        if calling is not None:
            fields, finish_reason = calling.message(r.text, finish_reason)
            message.update(fields)
        return {
            "index": r.index,
            "message": message,
            "logprobs": self._logprobs(
                r.token_ids,
                r.logprobs,
                r.top_logprobs,
                body.logprobs,
                body.return_tokens_as_token_ids,
            ),
            "finish_reason": finish_reason,
            "prompt_logprobs": prompt_logprobs_json(self.serving, r.prompt_logprobs),
        }

    async def _chunks(
        self,
        rid: str,
        group: Group,
        usage_in: UsageIn,
        logprobs: bool,
        calling: ToolCalling | None,
        as_ids: bool,
    ) -> AsyncGenerator[bytes, None]:
        """With `calling`, each choice's text goes through its ToolCallStream: content until
        calls begin, then tool-call deltas."""
        model = self.serving.model_of(group.requests[0])
        sse = ChunkEncoder(rid, "chat.completion.chunk", int(time.time()), model)
        role = {"role": "assistant", "content": ""}
        for result in group.results:
            choice = {"index": result.index, "delta": role, "logprobs": None, "finish_reason": None}
            # As vLLM: with continuous usage, every chunk carries it, the role's included.
            yield sse.event([choice], usage(group.results) if usage_in.every_chunk else None)
        num_sent = [0] * len(group.results)  # tokens whose logprobs went out (held-back text waits)
        streams = [calling.stream() if calling else None for _ in group.results]
        async with contextlib.aclosing(self.serving.runner.merged([group])) as outputs:
            async for result, out in outputs:
                stream = streams[result.index]
                finish_reason = out.finish_reason
                if stream is not None:
                    delta = stream.delta(result.text, out.finished)
                    finish_reason = stream.finish_reason(finish_reason) if out.finished else None
                else:
                    delta = {"content": out.new_text} if out.new_text else {}
                if not out.finished and not delta:
                    continue  # text held back (an incomplete character, a possible stop string)
                sent = num_sent[result.index]
                ids, lps = result.token_ids[sent:], result.logprobs[sent:]
                tops = result.top_logprobs[sent:]
                num_sent[result.index] = len(result.token_ids)
                choice = {
                    "index": result.index,
                    "delta": delta,
                    "logprobs": self._logprobs(ids, lps, tops, logprobs, as_ids),
                    "finish_reason": finish_reason,
                }
                if out.finish_reason == "error":
                    choice["error"] = out.error
                yield sse.event([choice], usage(group.results) if usage_in.every_chunk else None)
        if usage_in.last_chunk:
            yield sse.event([], usage(group.results))
        yield DONE

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float],
        tops: list[TopLogprobs],
        wanted: bool,
        as_ids: bool = False,
    ) -> dict[str, Any] | None:
        """Chat's shape: per token its text, logprob and bytes, and its alternatives (`tops`
        is empty when no alternatives were asked)."""
        if not wanted:
            return None
        content = []
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            entry = _entry(self.serving.token_text(token_id, as_ids), lp)
            alternatives = self.serving.alternatives(tops[i], as_ids) if tops else []
            entry["top_logprobs"] = [_entry(t, alt_lp) for t, alt_lp in alternatives]
            content.append(entry)
        return {"content": content}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _with_tool_calling(
    params: SamplingParams, calling: ToolCalling | None, asked_by: str | None
) -> tuple[SamplingParams, str | None]:
    """The params with what tool calling needs (a forced call's schema, which wins over any
    response_format as in vLLM; the special tokens a parser's markers are), and the field
    that asked for the output's grammar."""
    if calling is None:
        return params, asked_by
    schema = calling.schema()
    if schema is not None:
        structured = StructuredOutputsParams(json=json.dumps(schema))
        params = dataclasses.replace(params, structured_outputs=structured)
        asked_by = "tools"
    if calling.parser is not None and calling.parser.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, asked_by

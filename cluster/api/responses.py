"""`/v1/responses` (OpenAI's Responses API): the request runs as the chat completion it
translates to (same template, sampling, grammar and tool calls), and is answered as a
Response object, whole or as the Responses API's typed, numbered stream events.

Nothing is stored: the answer's id names no state that a later request could refer to.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdcluster.cluster.api.chat import Chat
from pdcluster.cluster.api.errors import APIError
from pdcluster.cluster.api.responses_protocol import ResponsesRequest
from pdcluster.cluster.api.results import Group, Result, usage
from pdcluster.cluster.api.sse import EventStreamResponse, named_event
from pdcluster.cluster.api.tools import ToolCalling, new_call_id

logger = logging.getLogger(__name__)

NOT_STORED = (
    "responses are not stored: this server keeps no state, so a response cannot be "
    "retrieved; keep the response the POST returned and send earlier turns in input"
)


class Responses:
    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self.serving = chat.serving

    async def __call__(self, http: Request) -> Response:
        body = await self.serving.parse(http, ResponsesRequest)
        if body.ignored_fields():
            logger.warning("/v1/responses ignored the fields %s", ", ".join(body.ignored_fields()))
        try:
            chat_body = body.chat_request()
        except ValidationError as exc:  # a tool_choice the tools do not allow
            raise APIError(400, exc.errors()[0]["msg"], "invalid_value", "tool_choice") from None
        rid = f"resp_{self.serving.request_id(http, chat_body)}"
        group, calling = await self.chat.prepare(chat_body, rid, "text.format")
        draft = Draft(rid, time.time(), body, group, self.serving.model_of(group.requests[0]))
        if body.stream:
            return EventStreamResponse(self._events(draft, calling))
        await self.serving.runner.run_to_end(http, [group])
        result = group.results[0]
        return JSONResponse(draft.finished(result, output_items(result, calling)))

    async def _events(
        self, draft: Draft, calling: ToolCalling | None
    ) -> AsyncGenerator[bytes, None]:
        """Without tools the text streams as it comes; with tools the output is read for
        calls once whole, and each of its items then goes out in one piece."""
        events = Events()
        yield events("response.created", response=draft.response("in_progress"))
        yield events("response.in_progress", response=draft.response("in_progress"))
        message_id = _item_id("msg")
        if calling is None:
            for event in events.open_message(message_id, 0):
                yield event
        result = draft.group.results[0]
        async with contextlib.aclosing(self.serving.runner.merged([draft.group])) as outputs:
            async for _, out in outputs:
                if calling is None and out.new_text:
                    yield events.text_delta(message_id, 0, out.new_text)
        if result.finish_reason == "error":
            error = {"code": "server_error", "message": result.error or "the request failed"}
            yield events("response.failed", response=draft.response("failed", error=error))
            return
        items = output_items(result, calling, message_id)
        for index, item in enumerate(items):
            for event in events.item(item, index, opened=calling is None):
                yield event
        final = draft.finished(result, items)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield events(kind, response=final)


@dataclass(frozen=True)
class Draft:
    """One response's identity and the request fields it echoes."""

    id: str
    created_at: float
    body: ResponsesRequest
    group: Group
    model: str

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        body, params = self.body, self.group.requests[0].sampling_params
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tools": tools,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": body.text_format()},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "store": False,
            "background": False,
            "previous_response_id": None,
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **fields,
        }

    def finished(self, result: Result, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response: "incomplete" when `max_output_tokens` (or the context) ran out."""
        if result.finish_reason == "length":
            reason = {"reason": "max_output_tokens"}
            return self.response("incomplete", output=items, incomplete_details=reason,
                                 usage=response_usage(result))  # fmt: skip
        return self.response("completed", output=items, usage=response_usage(result))


def output_items(
    result: Result, calling: ToolCalling | None, message_id: str | None = None
) -> list[dict[str, Any]]:
    """The output: a message with the text, and with tools, one `function_call` item per
    call read from it (the message only when text is left around the calls)."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    if calling is None:
        return [_message(message_id or _item_id("msg"), result.text, status)]
    content, calls = calling.parse(result.text)
    items = (
        []
        if calls and not content
        else [_message(message_id or _item_id("msg"), content or "", status)]
    )
    for call in calls:
        items.append({
            "type": "function_call", "id": _item_id("fc"), "call_id": new_call_id(),
            "name": call.name, "arguments": call.arguments, "status": "completed",
        })  # fmt: skip
    return items


def response_usage(result: Result) -> dict[str, Any]:
    counts = usage([result])
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},  # no reasoning parser: all is text
        "total_tokens": counts["total_tokens"],
    }


class Events:
    """The stream's events, numbered from 0 in the order they are sent."""

    def __init__(self) -> None:
        self._sequence_numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self._sequence_numbers), **fields}
        return named_event(payload)

    def open_message(self, item_id: str, index: int) -> list[bytes]:
        item = _message(item_id, "", "in_progress")
        item["content"] = []
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self("response.output_item.added", output_index=index, item=item),
            self("response.content_part.added", **where, part=_text_part("")),
        ]

    def text_delta(self, item_id: str, index: int, text: str) -> bytes:
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return self("response.output_text.delta", **where, delta=text, logprobs=[])

    def item(self, item: dict[str, Any], index: int, opened: bool) -> list[bytes]:
        """A finished item's events (`opened`: a message whose text was streamed already)."""
        if item["type"] == "function_call":
            return self._function_call(item, index)
        events = [] if opened else self.open_message(item["id"], index)
        text = item["content"][0]["text"]
        if text and not opened:
            events.append(self.text_delta(item["id"], index, text))
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            *events,
            self("response.output_text.done", **where, text=text, logprobs=[]),
            self("response.content_part.done", **where, part=item["content"][0]),
            self("response.output_item.done", output_index=index, item=item),
        ]

    def _function_call(self, item: dict[str, Any], index: int) -> list[bytes]:
        where = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            self("response.output_item.added", output_index=index, item=added),
            self("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),  # fmt: skip
            self("response.output_item.done", output_index=index, item=item),
        ]


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"

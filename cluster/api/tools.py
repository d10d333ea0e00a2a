"""Function calling on chat completions: the grammar of a forced call, and the calls parsed
from a model's output.

With `tool_choice` "auto" the chat template renders the tools and the model may answer with
Hermes-style calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format of
Qwen2.5, Hermes and similar templates). With "required" or a named function, the output is
constrained to one call's JSON, `{"name": ..., "arguments": {...}}`, by the request's grammar.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.messages import NamedToolChoice, Tool

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallParser:
    """Reads the calls of one request's finished output; `forced`: the output is one call's
    JSON (tool_choice "required" or named), else Hermes-style blocks among text."""

    forced: bool
    max_calls: int | None = None  # parallel_tool_calls false: 1, later calls dropped

    def message(
        self, text: str, finish_reason: str | None, streamed: bool = False
    ) -> tuple[dict[str, Any], str | None]:
        """(the assistant message's fields, the finish reason): with any call, its
        `tool_calls` (indexed when `streamed`, as deltas are) and finish reason "tool_calls"."""
        content, calls = parse_tool_calls(text, self.forced)
        calls = calls[: self.max_calls]
        if not calls:
            return {"content": content}, finish_reason
        if streamed:
            calls = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"content": content, "tool_calls": calls}, "tool_calls"


def forced_call_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema of the call `tool_choice` forces (any of the tools for "required",
    the named one otherwise), or None when the model is free to answer in text."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in body.tools or [] if t.function.name == choice.function.name]
    elif choice == "required":
        tools = list(body.tools or [])
    else:
        return None
    calls = [_call_schema(t) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.function.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tool_calls(text: str, forced: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content left, OpenAI `tool_calls`) of an output. A forced output is one call's
    JSON; otherwise every well-formed `<tool_call>` block is a call and the rest is content.
    An output with no call is all content."""
    if forced:
        found = [_as_call(text)]
        content = ""
    else:
        found = [_as_call(block) for block in _HERMES_CALL.findall(text)]
        content = _HERMES_CALL.sub("", text).strip()
    calls = [call for call in found if call is not None]
    if not calls:
        return text, []
    return content or None, calls


def _as_call(text: str) -> dict[str, Any] | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(arguments)},
    }

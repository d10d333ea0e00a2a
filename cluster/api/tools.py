"""Function calling on chat completions and responses, as vLLM serves it.

- `tool_choice` a named function: the output is constrained to that function's parameters
  schema and is the call's arguments, streamed as they are written; finish reason as sampled.
- "required": the output is constrained to a JSON list of `{"name", "parameters"}` among the
  tools (one at most with `parallel_tool_calls` false); finish reason "tool_calls".
- "auto" (with `--enable-auto-tool-choice --tool-call-parser NAME`): the model writes calls in
  its family's format among text, read by that parser (tool_parsers.py); text before a call
  streams as content.
- "none", or no tools: plain text.

Any model serves the forced choices: a chat template that renders no tools gets them from
`default_tool_prompt`, in a system message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.messages import NamedToolChoice, Tool
from pdcluster.cluster.api.tool_parsers import Parsed, ParsedCall, ToolParser, json_values

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True)
class ToolCalling:
    """How one request's output becomes calls: `named` (a function tool_choice names), else
    `required`, else `parser` reads the calls that "auto" lets the model write."""

    tools: tuple[Tool, ...]
    named: str | None = None
    required: bool = False
    parser: ToolParser | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser | None) -> ToolCalling | None:
        """The request's tool calling, or None when it offers no tools (or tool_choice "none").
        `parser`: the server's auto tool-call parser, None when auto is not enabled (then
        "auto" is a ValueError, as in vLLM)."""
        if not body.calls_tools():
            return None
        choice, tools = body.tool_choice, tuple(body.tools or ())
        max_calls = None if body.parallel_tool_calls else 1
        if isinstance(choice, NamedToolChoice):
            return cls(tools, named=choice.function.name, max_calls=1)
        if choice == "required":
            return cls(tools, required=True, max_calls=max_calls)
        if parser is None:
            raise ValueError(AUTO_NEEDS_FLAGS)
        return cls(tools, parser=parser, max_calls=max_calls)

    @property
    def forced(self) -> bool:
        return self.named is not None or self.required

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema structured decoding holds a forced output to (None for auto)."""
        if self.named is not None:
            return _parameters(next(t for t in self.tools if t.function.name == self.named))
        if not self.required:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.max_calls is not None:
            array["maxItems"] = self.max_calls
        return array

    def parse(self, text: str) -> Parsed:
        """(content, calls) of a whole output."""
        if self.named is not None:
            return None, [ParsedCall(self.named, text)]
        if self.required:
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        assert self.parser is not None
        content, calls = self.parser.parse(text, self.tools)  # all content when no call
        return content, calls[: self.max_calls]

    def finish_reason(self, calls: Sequence[ParsedCall], sampled: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto read calls or required stopped on its own; a named
        call keeps the sampled reason (as OpenAI's)."""
        if calls and self.parser is not None:
            return "tool_calls"
        if calls and self.required and sampled == "stop":
            return "tool_calls"
        return sampled

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message's content and tool_calls, the finish reason) of an output."""
        content, calls = self.parse(text)
        fields: dict[str, Any] = {"content": content}
        if calls:
            fields["tool_calls"] = [call_json(c) for c in calls]
        return fields, self.finish_reason(calls, finish_reason)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def call_json(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI's `tool_calls` entry (with `index`: a streamed delta's)."""
    entry: dict[str, Any] = {} if index is None else {"index": index}
    function = {"name": call.name, "arguments": call.arguments}
    return {**entry, "id": new_call_id(), "type": "function", "function": function}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    """One streamed choice's deltas: `delta(text, finished)` takes the whole text so far and
    answers what to send now (content, tool-call deltas, or nothing)."""

    calling: ToolCalling
    sent: int = 0  # characters of the text sent as content or arguments
    calls_start: int | None = None  # auto: where the calls begin, once seen
    calls: list[ParsedCall] = field(default_factory=list)  # calls sent

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        calling = self.calling
        if calling.named is not None:
            return self._arguments(calling.named, text)
        if calling.required:
            return self._required(text)
        return self._auto(text, finished)

    def finish_reason(self, sampled: str | None) -> str | None:
        return self.calling.finish_reason(self.calls, sampled)

    def _arguments(self, name: str, text: str) -> dict[str, Any]:
        """A named call: the header with the first text, then each new piece of arguments."""
        new, self.sent = text[self.sent :], len(text)
        if not self.calls:
            self.calls.append(ParsedCall(name, ""))
            return {"tool_calls": [call_json(ParsedCall(name, new), 0)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]} if new else {}

    def _required(self, text: str) -> dict[str, Any]:
        """Each call of the list goes out once its object is complete."""
        calls = _required_calls(text)
        new = calls[len(self.calls) :]
        first = len(self.calls)
        self.calls.extend(new)
        if not new:
            return {}
        return {"tool_calls": [call_json(c, first + i) for i, c in enumerate(new)]}

    def _auto(self, text: str, finished: bool) -> dict[str, Any]:
        """Content streams until the parser sees calls begin; the rest waits for the end."""
        parser = self.calling.parser
        assert parser is not None
        if self.calls_start is None:
            self.calls_start = parser.calls_start(text)
        if self.calls_start is None:
            end = len(text) if finished else len(text) - parser.held_back(text)
            return self._content(text, end)
        if not finished:
            return self._content(text, self.calls_start)
        delta = self._content(text, self.calls_start)
        rest = text[self.calls_start :]
        content, calls = parser.parse(rest, self.calling.tools)
        calls = calls[: self.calling.max_calls]
        if not calls:  # no well-formed call after all: the rest is content too
            self.sent = self.calls_start
            return self._content(text, len(text))
        self.calls = calls
        if content:
            delta["content"] = delta.get("content", "") + content
        delta["tool_calls"] = [call_json(c, i) for i, c in enumerate(calls)]
        self.sent = len(text)
        return delta

    def _content(self, text: str, end: int) -> dict[str, Any]:
        if end <= self.sent:
            return {}
        new, self.sent = text[self.sent : end], end
        return {"content": new}


def default_tool_prompt(tools: Sequence[Tool], parser: ToolParser | None) -> str:
    """The tools as a system prompt, for a chat template that renders none: the functions'
    JSON definitions, then how to call one when the model may choose (`parser`'s format)."""
    lines = ["You can call these functions, given as JSON schemas:", "<tools>"]
    lines += [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    lines.append("</tools>")
    if parser is not None:
        lines.append(parser.format_hint)
    return "\n".join(lines)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of a "required" output, `[{"name": ..., "parameters": {...}}, ...]`: all of
    them when the list parses; else (a list still being written, or cut off) those whose
    objects are complete."""
    try:
        items = json.loads(text)
    except ValueError:  # cut off: the items before the first one not complete
        start = text.find("[")
        items = [] if start < 0 else list(json_values(text[start + 1 :], separators=","))
    if not isinstance(items, list):
        return []
    calls = [
        ParsedCall.of(i.get("name"), i.get("parameters", {})) if isinstance(i, dict) else None
        for i in items
    ]
    return [c for c in calls if c is not None]

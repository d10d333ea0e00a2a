"""Tool-call parsers for `tool_choice` "auto": each reads the calls a model family writes in
its own format out of its text (`--tool-call-parser NAME`, names as vLLM's).

A parser answers two questions: where in a streamed text the calls may begin (so that the
text before goes out as content while the rest waits), and, once the text is whole, which
calls it holds and which text is left as content. Text that does not parse as calls is
content: a model that only talks about a call is answered as a plain reply.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.cluster.api.messages import Tool

# Special tokens a kept-special-tokens text may end with (<|eom_id|>, <|eot_id|>, ...).
_END_TOKENS = re.compile(r"(\s*<\|[a-z_]+\|>)+\s*$")


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    @classmethod
    def of(cls, name: Any, arguments: Any) -> ParsedCall | None:
        """A call from decoded JSON parts; None when they are not a name and an object."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        try:
            return cls(name, json.dumps(arguments, ensure_ascii=False))
        except (TypeError, ValueError):  # a value JSON cannot hold (a Python set, say)
            return None


Parsed = tuple[str | None, list[ParsedCall]]  # (the content left, the calls)


class ToolParser:
    """The base: calls start at the first of `markers`; `parse_calls` reads the text from
    there. Subclasses set `markers` and `format_hint`, and override what differs."""

    markers: tuple[str, ...] = ()
    # How the default tool prompt (a template that renders no tools) asks for a call.
    format_hint: str = ""
    # The markers are special tokens, which a detokenizer drops unless told to keep them.
    keeps_special_tokens: bool = False

    def calls_start(self, text: str) -> int | None:
        """Where calls begin in `text` (None: not yet). Text before it is content for sure."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text`, with no call begun, could still be the
        start of one (a marker's first characters): a stream holds them back."""
        for size in range(min(len(text), max(map(len, self.markers), default=0)), 0, -1):
            if any(m.startswith(text[-size:]) for m in self.markers):
                return size
        return 0

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed:
        """(content, calls) of a whole output; all content when it holds no well-formed call."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:], tools)
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        raise NotImplementedError


class WholeReplyParser(ToolParser):
    """Formats whose calls are the whole reply: it opens with `opener` (after white space),
    or with the special token `tag` first."""

    keeps_special_tokens = True
    tag: str = ""
    opener: str = ""

    def calls_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith((self.tag, self.opener)):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.tag.startswith(stripped):
            return len(text)  # nothing but space yet, or the tag's first characters
        return 0


class HermesParser(ToolParser):
    """Hermes 2/3 and Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call."""

    markers = ("<tool_call>",)
    format_hint = (
        'To call a function, answer with <tool_call>{"name": <function name>, '
        '"arguments": <arguments as a JSON object>}</tool_call>, one block per call.'
    )
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        return _all_or_none(_json_call(block) for block in self._BLOCK.findall(text))


class Llama3JSONParser(WholeReplyParser):
    """Llama 3.1-3.3 (and 4 in JSON mode): the reply is the call(s) itself,
    `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated
    by semicolons."""

    format_hint = (
        'To call a function, answer with only {"name": <function name>, "parameters": '
        "<arguments as a JSON object>}; separate several calls with semicolons."
    )
    tag, opener = "<|python_tag|>", "{"

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        text = _END_TOKENS.sub("", text.strip().removeprefix(self.tag))
        return _all_or_none(_json_call(obj) for obj in json_values(text, separators=";"))


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers), or
    `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later)."""

    markers = ("[TOOL_CALLS]",)
    format_hint = (
        'To call functions, answer with [TOOL_CALLS][{"name": <function name>, "arguments": '
        "<arguments as a JSON object>}, ...]."
    )
    keeps_special_tokens = True

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        calls: list[ParsedCall | None] = []
        for chunk in text.split("[TOOL_CALLS]")[1:]:
            name, sep, arguments = chunk.partition("[ARGS]")
            if sep:
                calls.append(_first_json_call(name.strip(), arguments))
                continue
            values = list(json_values(chunk.strip()))
            if len(values) != 1 or not isinstance(values[0], list):
                return []
            calls.extend(_json_call(item) for item in values[0])
        return _all_or_none(calls)


class Qwen3XMLParser(ToolParser):
    """Qwen3-Coder and Qwen3 XML: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
    ...</function></tool_call>`; values are text, typed by the tool's parameter schema."""

    markers = ("<tool_call>", "<function=")
    format_hint = (
        "To call a function, answer with <tool_call>\n<function=NAME>\n<parameter=KEY>\n"
        "VALUE\n</parameter>\n</function>\n</tool_call>, one block per call."
    )
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)",
                            re.DOTALL)  # fmt: skip

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        calls = []
        for name, body in self._FUNCTION.findall(text):
            name = name.strip()
            schema = _parameter_schemas(tools, name)
            arguments = {
                key.strip(): _typed(value, schema.get(key.strip(), {}))
                for key, value in self._PARAMETER.findall(body)
            }
            calls.append(ParsedCall.of(name, arguments))
        return _all_or_none(calls)


class PythonicParser(WholeReplyParser):
    """Llama 3.2 / 4 pythonic: `[get_weather(city="Paris"), get_time()]`, keyword arguments
    of literal values, optionally between `<|python_start|>` and `<|python_end|>`."""

    format_hint = (
        'To call functions, answer with only a Python list of calls, e.g. [name(key="value")].'
    )
    tag, opener = "<|python_start|>", "["
    _END = "<|python_end|>"

    def parse_calls(self, text: str, tools: Sequence[Tool]) -> list[ParsedCall]:
        source = _END_TOKENS.sub("", text.strip()).removeprefix(self.tag)
        source = source.removesuffix(self._END).strip()
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return []
        if not isinstance(tree, ast.List):
            return []
        return _all_or_none(_python_call(node) for node in tree.elts)


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JSONParser,
    "llama4_json": Llama3JSONParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3XMLParser,
    "qwen3_xml": Qwen3XMLParser,
    "pythonic": PythonicParser,
    "llama4_pythonic": PythonicParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser registered as `name` (the config checks the name)."""
    return PARSERS[name]()


def _all_or_none(calls: Iterator[ParsedCall | None] | list[ParsedCall | None]) -> list[ParsedCall]:
    """Every call, or none when any is malformed (the text is then read as content)."""
    found = list(calls)
    if not found or any(c is None for c in found):
        return []
    return [c for c in found if c is not None]


def _json_call(value: Any) -> ParsedCall | None:
    """`{"name": ..., "arguments"|"parameters": {...}}`, as text or decoded."""
    if isinstance(value, str):
        try:
            value = json.loads(value.strip())
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedCall.of(value.get("name"), arguments)


def _first_json_call(name: str, text: str) -> ParsedCall | None:
    values = list(json_values(text.strip()))
    return ParsedCall.of(name, values[0]) if len(values) == 1 else None


def json_values(text: str, separators: str = "") -> Iterator[Any]:
    """The JSON values written one after another in `text` (space and `separators` between
    them); stops at the first thing that is not one, yielding None for it."""
    decoder = json.JSONDecoder()
    position = 0
    while position < len(text):
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            yield None
            return
        yield value


def _parameter_schemas(tools: Sequence[Tool], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool.function.name == name:
            properties = (tool.function.parameters or {}).get("properties", {})
            return properties if isinstance(properties, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """An XML parameter's text as its schema's type: strings stay text; numbers, booleans,
    objects and arrays are read as JSON (then as a Python literal), else kept as text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (kind is None and not value.strip()):
        return value
    for read in (json.loads, ast.literal_eval):
        try:
            return read(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def _python_call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except ValueError:
        return None
    if len(arguments) != len(node.keywords):
        return None
    return ParsedCall.of(node.func.id, arguments)

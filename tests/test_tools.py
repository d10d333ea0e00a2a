"""Function calling without a cluster: which templates render tools, and reading calls."""

from __future__ import annotations

import json

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.tools import forced_call_schema, parse_tool_calls
from pdcluster.engine.preset_tokenizer import chat_template
from pdcluster.engine.tokenizer import chat_template_takes_tools, compile_chat_template

# ChatML with Hermes-style tools: the tools listed in a system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in "tool" turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "You can call functions. To call one, answer with "
    '<tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.\n'
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_only_templates_that_render_tools_take_them():
    assert chat_template_takes_tools(TOOLS_TEMPLATE)
    assert not chat_template_takes_tools(chat_template(allow_images=False, add_bos=False))


def test_the_tools_template_renders_tools_and_earlier_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    text = compile_chat_template(TOOLS_TEMPLATE).render(
        messages=[{"role": "assistant", "content": None, "tool_calls": [call]}],
        tools=[tool],
        add_generation_prompt=True,
    )
    assert json.dumps(tool) in text
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, forced=False)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in calls}) == 2


def test_text_without_a_well_formed_call_is_all_content():
    for text in ("just words", "<tool_call>{not json}</tool_call>", '<tool_call>["x"]</tool_call>'):
        assert parse_tool_calls(text, forced=False) == (text, [])


def test_a_forced_output_is_one_call():
    content, [call] = parse_tool_calls('{"name": "f", "arguments": {"a": [1]}}', forced=True)
    assert content is None and call["function"] == {"name": "f", "arguments": '{"a": [1]}'}


def test_forced_call_schemas():
    def body(**fields) -> ChatCompletionRequest:
        tools = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("a", "b")
        ]
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools, **fields}
        )

    assert forced_call_schema(body()) is None
    assert forced_call_schema(body(tool_choice="auto")) is None
    named = forced_call_schema(body(tool_choice={"type": "function", "function": {"name": "b"}}))
    assert named["properties"]["name"] == {"const": "b"}
    required = forced_call_schema(body(tool_choice="required"))
    assert [s["properties"]["name"]["const"] for s in required["anyOf"]] == ["a", "b"]

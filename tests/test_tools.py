"""Function calling without a cluster: the parsers on each family's own output format, the
forced calls' schemas and streams, and how any chat template gets the tools."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdcluster.cluster.api.chat_protocol import ChatCompletionRequest
from pdcluster.cluster.api.chat_render import ChatRenderer, template_traits
from pdcluster.cluster.api.messages import Tool
from pdcluster.cluster.api.responses_protocol import ResponsesRequest
from pdcluster.cluster.api.tool_parsers import PARSERS, ParsedCall, tool_parser
from pdcluster.cluster.api.tools import AUTO_NEEDS_FLAGS, ToolCalling
from pdcluster.cluster.config import GatewaySettings
from pdcluster.engine.preset_tokenizer import chat_template
from pdcluster.engine.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
    "metric": {"type": "boolean"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
ROME = ParsedCall("get_weather", '{"city": "Rome", "days": 2}')
CHATML = chat_template(allow_images=False, add_bos=False)
TOOLS_CHATML = chat_template(allow_images=False, add_bos=False, tools=True)


def body(**fields) -> ChatCompletionRequest:
    messages = fields.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return ChatCompletionRequest(model="m", messages=messages, tools=[WEATHER, TIME], **fields)


# ---- parsers, each on its family's output ------------------------------------------------
FAMILY_OUTPUTS = {
    # Qwen2.5 / Hermes 2-3: one block per call, text around them
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
        '"days": 2}}\n</tool_call>',
        "Let me check.",
    ),
    # Llama 3.1-3.3: the reply is the JSON, after <|python_tag|> when special tokens are kept
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}<|eom_id|>',
        None,
    ),
    # Mistral v3 tokenizers: a JSON list after [TOOL_CALLS] (kept with a space around it)
    "mistral": (
        ' [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
        None,
    ),
    # Qwen3-Coder: XML with text values, typed by the schema
    "qwen3_coder": (
        "I'll look both up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
        "</tool_call>",
        "I'll look both up.",
    ),
    # Llama 3.2 / 4 pythonic
    "pythonic": ("[get_weather(city='Paris'), get_weather(city=\"Rome\", days=2)]", None),
}


@pytest.mark.parametrize("name", list(FAMILY_OUTPUTS))
def test_each_parser_reads_its_familys_calls(name):
    text, content = FAMILY_OUTPUTS[name]
    assert tool_parser(name).parse(text, TOOLS) == (content, [PARIS, ROME])


def test_mistral_v11_calls_name_then_args():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]' + (
        '{"city": "Rome", "days": 2}'
    )
    assert tool_parser("mistral").parse(text, TOOLS) == (None, [PARIS, ROME])


def test_qwen3_xml_values_follow_the_schema():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    [call] = tool_parser("qwen3_coder").parse(text, TOOLS)[1]
    assert json.loads(call.arguments) == {"city": "42", "days": 3, "metric": True}


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        '[TOOL_CALLS] [{"name": 3}]',
        "[get_weather(**kw)]",
        '{"city": "Paris"}',
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n{1}\n</parameter>",
    ],
)
def test_text_without_well_formed_calls_is_content(name, text):
    content, calls = tool_parser(name).parse(text, TOOLS)
    if calls:  # only the XML parser reads a value it cannot type as text
        assert name.startswith("qwen3") and calls[0].arguments == '{"city": "{1}"}'
    else:
        assert content == text


# ---- forced calls: schemas, whole and streamed -------------------------------------------
def test_a_named_call_is_the_functions_arguments():
    calling = ToolCalling.of(
        body(tool_choice={"type": "function", "function": {"name": "get_time"}}), None
    )
    assert calling.schema() == TIME["function"]["parameters"]
    fields, reason = calling.message('{"zone": "utc"}', "stop")
    assert reason == "stop" and fields["content"] is None  # as OpenAI: a named call stops
    [call] = fields["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}


def test_a_named_call_streams_its_arguments_as_written():
    calling = ToolCalling.of(
        body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), None
    )
    stream, text = calling.stream(), '{"city": "Paris"}'
    deltas = [stream.delta(text[:n], n == len(text)) for n in (3, 9, len(text))]
    [first] = deltas[0]["tool_calls"]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas]
    assert "".join(pieces) == text and all(pieces)
    assert stream.finish_reason("stop") == "stop"


def test_required_is_a_list_of_calls_among_the_tools():
    calling = ToolCalling.of(body(tool_choice="required"), None)
    schema = calling.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    fields, reason = calling.message(text, "stop")
    assert reason == "tool_calls" and [c["function"]["name"] for c in fields["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    one = ToolCalling.of(body(tool_choice="required", parallel_tool_calls=False), None)
    assert one.schema()["maxItems"] == 1


def test_required_streams_each_call_once_complete():
    calling = ToolCalling.of(body(tool_choice="required"), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    stream = calling.stream()
    cut = text.index("}}") + 2
    assert stream.delta(text[: cut - 3], False) == {}
    [first] = stream.delta(text[:cut], False)["tool_calls"]
    assert first["index"] == 0 and first["function"]["arguments"] == '{"city": "Paris"}'
    [second] = stream.delta(text, True)["tool_calls"]
    assert second["index"] == 1 and second["function"]["name"] == "get_time"
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"


# ---- auto ---------------------------------------------------------------------------------
def test_auto_needs_the_servers_parser_as_in_vllm():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ToolCalling.of(body(), None)  # tools without tool_choice: auto
    assert AUTO_NEEDS_FLAGS.startswith('"auto" tool choice requires')
    assert ToolCalling.of(body(tool_choice="none"), None) is None


def test_auto_streams_content_until_a_call_begins():
    calling = ToolCalling.of(body(), tool_parser("hermes"))
    text = 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = calling.stream()
    assert stream.delta("Checking <tool", False) == {"content": "Checking "}  # "<tool" held
    assert stream.delta(text[:30], False) == {}
    last = stream.delta(text, True)
    assert (
        "content" not in last and last["tool_calls"][0]["function"]["arguments"] == PARIS.arguments
    )
    assert stream.finish_reason("stop") == "tool_calls"


def test_auto_sends_held_text_as_content_when_no_call_follows():
    stream = ToolCalling.of(body(), tool_parser("hermes")).stream()
    assert stream.delta("a <tool", False) == {"content": "a "}
    assert stream.delta("a <tool_call> is a tag", True) == {"content": "<tool_call> is a tag"}
    assert stream.finish_reason("stop") == "stop"
    message, reason = ToolCalling.of(body(), tool_parser("hermes")).message("plain", "length")
    assert message == {"content": "plain"} and reason == "length"


def test_auto_with_parallel_calls_off_keeps_the_first():
    calling = ToolCalling.of(body(parallel_tool_calls=False), tool_parser("hermes"))
    fields, _ = calling.message(FAMILY_OUTPUTS["hermes"][0], "stop")
    assert [json.loads(c["function"]["arguments"]) for c in fields["tool_calls"]] == [
        {"city": "Paris"}
    ]


# ---- templates ----------------------------------------------------------------------------
def test_template_traits():
    assert template_traits(TOOLS_CHATML).tools and template_traits(TOOLS_CHATML).tool_calls
    assert not template_traits(CHATML).tools and not template_traits(CHATML).tool_calls
    assert not chat_template(True, True).count("tool")


@pytest.fixture(scope="module")
def tokenizer(preset_dir):
    return Tokenizer(preset_dir("tiny-llama"))


def test_a_template_without_tools_gets_them_in_a_system_prompt(tokenizer):
    renderer = ChatRenderer(tokenizer, CHATML)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for messages, parser in (([{"role": "user", "content": "Hi"}], None), (system, "hermes")):
        chat = body(messages=messages, tool_choice="auto" if parser else "required")
        calling = ToolCalling.of(chat, tool_parser(parser) if parser else None)
        prompt = renderer.render(chat, True, calling)
        assert prompt.startswith("<|im_start|>system\n") and prompt.count("<|im_start|>system") == 1
        assert json.dumps(WEATHER) in prompt
        assert ("<tool_call>" in prompt) == (parser is not None)  # how to call, for auto
        assert ("Be brief." in prompt) == (parser is not None)
    plain = renderer.render(body(tool_choice="none"), True, None)
    assert "get_weather" not in plain


def test_earlier_calls_render_in_any_template(tokenizer):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 degrees"},
    ]
    expected = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for template in (CHATML, TOOLS_CHATML):
        prompt = ChatRenderer(tokenizer, template).render(
            body(messages=messages, tool_choice="none")
        )
        assert expected in prompt and "4 degrees" in prompt
    with_tools = ChatRenderer(tokenizer, TOOLS_CHATML).render(
        body(messages=messages, tool_choice="required"),
        True,
        ToolCalling.of(body(tool_choice="required"), None),
    )
    assert "<tool_response>\n4 degrees\n</tool_response>" in with_tools


def test_the_requests_template_and_the_content_format_are_honoured(tokenizer):
    chat = body(tool_choice="required", chat_template=TOOLS_CHATML)
    prompt = ChatRenderer(tokenizer, CHATML).render(chat, True, ToolCalling.of(chat, None))
    assert "<tools>" in prompt and "You can call these functions" in prompt
    parts = body(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    as_string = ChatRenderer(tokenizer, CHATML, "string").render(parts)
    assert "a\nb" in as_string
    as_parts = ChatRenderer(tokenizer, CHATML, "openai").render(parts)
    assert "<|im_start|>user\nab<|im_end|>" in as_parts


# ---- settings and the Responses API -------------------------------------------------------
def test_tool_settings_are_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ValidationError, match="needs tool_call_parser"):
        GatewaySettings(enable_auto_tool_choice=True)
    with pytest.raises(ValidationError, match="unknown; known: hermes"):
        GatewaySettings(tool_call_parser="nope")
    path = tmp_path / "t.jinja"
    path.write_text(TOOLS_CHATML)
    assert GatewaySettings(chat_template=str(path)).chat_template == TOOLS_CHATML
    assert GatewaySettings(chat_template="{{ x }}").chat_template == "{{ x }}"
    with pytest.raises(ValidationError, match="neither a chat template nor a file"):
        GatewaySettings(chat_template=str(tmp_path / "missing.jinja"))


def test_responses_tool_fields_reach_the_chat_request():
    request = ResponsesRequest.model_validate({
        "model": "m", "input": "Weather?", "parallel_tool_calls": False,
        "tools": [{"type": "function", **WEATHER["function"]}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = request.chat_request()
    assert not chat.parallel_tool_calls and chat.tool_choice.function.name == "get_weather"
    assert ToolCalling.of(chat, None).named == "get_weather"  # the tool's schema wins


@pytest.mark.parametrize(
    ("name", "tag"), [("llama3_json", "<|python_tag|>"), ("pythonic", "<|python_start|>")]
)
def test_whole_reply_formats_hold_only_what_could_open_a_call(name, tag):
    parser = tool_parser(name)
    assert parser.held_back("  ") == 2 and parser.held_back(" " + tag[:5]) == 6
    assert parser.calls_start(" " + tag) == 1 and parser.calls_start("Sure, ") is None
    stream = ToolCalling.of(body(), parser).stream()
    assert stream.delta(" ", False) == {}
    assert stream.delta(" It is mild.", True) == {"content": " It is mild."}
